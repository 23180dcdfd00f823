//! Reads a gzip-compressed profile.proto back into samples of frames: enough for `memprof diff`
//! to read the profiles memprof writes (and Go's heap profiles, which use the same fields).

use std::collections::{hash_map::Entry, HashMap};

use flate2::read::GzDecoder;

use super::{
    field,
    wire::{Reader, Value, WireError},
    NO_STACK, STACK_ID_LABEL,
};
use crate::{
    format::{read_at_most, MAX_INPUT_BYTES},
    symbolize::{capped, Frame, FrameInfo},
};

#[derive(Debug, thiserror::Error)]
pub enum PprofError {
    #[error("neither a gzip-compressed nor a plain profile.proto")]
    NotAProfile,
    #[error("cannot decompress it: {0}")]
    Gzip(std::io::Error),
    #[error("it decompresses to more than {} MiB, more than any profile memprof reads", MAX_INPUT_BYTES >> 20)]
    TooLarge,
    #[error("not a profile.proto: {0}")]
    Wire(WireError),
    #[error("not a profile.proto: {0}")]
    Malformed(&'static str),
    #[error("a sample has more than {MAX_SAMPLE_FRAMES} frames, more than any profile memprof reads")]
    TooDeep,
}

/// The most frames a sample may have: memprof's stacks have at most 127 frames and their inlined
/// ones; past this a few bytes of ids would stand for gigabytes of frames.
const MAX_SAMPLE_FRAMES: usize = 4096;

/// By hand, not `#[from]`: the message says the wire error already, which as a source too would
/// be said twice.
impl From<WireError> for PprofError {
    fn from(err: WireError) -> Self {
        Self::Wire(err)
    }
}

/// A profile's samples, their frames resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The sample types' names, in the order of each sample's values.
    pub sample_types: Vec<String>,
    pub default_sample_type: String,
    pub samples: Vec<Sample>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub values: Vec<u64>,
    /// Innermost first, inlined frames marked as in a report.
    pub frames: Vec<Frame>,
    /// The `stack_id` label memprof gives each sample.
    pub stack_id: Option<String>,
}

impl Decoded {
    /// Where the values of the sample type `name` are.
    pub fn value_index(&self, name: &str) -> Option<usize> {
        self.sample_types.iter().position(|t| t == name)
    }
}

/// Reads a profile, gzip-compressed (as profilers write them) or not (as `go tool pprof` also
/// reads them).
pub fn read(gzipped: &[u8]) -> Result<Decoded, PprofError> {
    if !gzipped.starts_with(&[0x1f, 0x8b]) {
        return decode(gzipped).map_err(|_| PprofError::NotAProfile);
    }
    // A gzip bomb is refused at the limit, not once decompressed.
    let profile = read_at_most(GzDecoder::new(gzipped), MAX_INPUT_BYTES)
        .map_err(PprofError::Gzip)?
        .ok_or(PprofError::TooLarge)?;
    decode(&profile)
}

/// The profile's messages as found, before ids are resolved.
#[derive(Default)]
struct Raw<'a> {
    strings: Vec<&'a [u8]>,
    /// Type name string ids.
    sample_types: Vec<u64>,
    default_sample_type: u64,
    samples: Vec<&'a [u8]>,
    /// By id: (filename string id, start, file offset).
    mappings: HashMap<u64, (u64, u64, u64)>,
    locations: HashMap<u64, RawLocation>,
    /// By id: (name, file name) string ids.
    functions: HashMap<u64, (u64, u64)>,
}

pub(super) fn decode(profile: &[u8]) -> Result<Decoded, PprofError> {
    let mut raw = Raw::default();
    for entry in Reader::new(profile) {
        use field::profile as p;
        let (number, value) = entry?;
        match number {
            p::SAMPLE_TYPE => raw.sample_types.push(field_of(value.bytes()?, field::value_type::TYPE)?),
            p::SAMPLE => raw.samples.push(value.bytes()?),
            p::MAPPING => {
                use field::mapping as m;
                let fields = ints(value.bytes()?)?;
                let get = |n| fields.get(&n).copied().unwrap_or(0);
                raw.mappings.insert(get(m::ID), (get(m::FILENAME), get(m::MEMORY_START), get(m::FILE_OFFSET)));
            }
            p::LOCATION => {
                let (id, location) = location(value.bytes()?)?;
                raw.locations.insert(id, location);
            }
            p::FUNCTION => {
                use field::function as f;
                let fields = ints(value.bytes()?)?;
                let get = |n| fields.get(&n).copied().unwrap_or(0);
                raw.functions.insert(get(f::ID), (get(f::NAME), get(f::FILENAME)));
            }
            p::STRING_TABLE => raw.strings.push(value.bytes()?),
            p::DEFAULT_SAMPLE_TYPE => raw.default_sample_type = value.int()?,
            _ => {}
        }
    }
    if raw.sample_types.is_empty() {
        return Err(PprofError::Malformed("it has no sample types"));
    }
    raw.resolve()
}

#[derive(Default)]
struct RawLocation {
    mapping: u64,
    address: u64,
    /// (function id, line), innermost first.
    lines: Vec<(u64, u64)>,
}

/// The integer fields of a message, by number (the last of each).
fn ints(message: &[u8]) -> Result<HashMap<u32, u64>, PprofError> {
    let mut fields = HashMap::new();
    for entry in Reader::new(message) {
        if let (number, Value::Int(n)) = entry? {
            fields.insert(number, n);
        }
    }
    Ok(fields)
}

fn field_of(message: &[u8], number: u32) -> Result<u64, PprofError> {
    Ok(ints(message)?.get(&number).copied().unwrap_or(0))
}

/// A location and its id.
fn location(message: &[u8]) -> Result<(u64, RawLocation), PprofError> {
    use field::location as l;
    let (mut id, mut location) = (0, RawLocation::default());
    for entry in Reader::new(message) {
        match entry? {
            (l::ID, value) => id = value.int()?,
            (l::MAPPING_ID, value) => location.mapping = value.int()?,
            (l::ADDRESS, value) => location.address = value.int()?,
            (l::LINE, value) => {
                let line = ints(value.bytes()?)?;
                let get = |n| line.get(&n).copied().unwrap_or(0);
                location.lines.push((get(field::line::FUNCTION_ID), get(field::line::LINE)));
            }
            _ => {}
        }
    }
    Ok((id, location))
}

impl Raw<'_> {
    fn string(&self, id: u64) -> Result<String, PprofError> {
        let bytes = self.strings.get(id as usize).ok_or(PprofError::Malformed("a string index is out of range"))?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn resolve(&self) -> Result<Decoded, PprofError> {
        let sample_types = self.sample_types.iter().map(|&id| self.string(id)).collect::<Result<_, _>>()?;
        // Each location's frames are made once and shared by every sample that names it.
        let mut located = HashMap::new();
        let samples = self.samples.iter().map(|s| self.sample(s, &mut located)).collect::<Result<_, _>>()?;
        Ok(Decoded { sample_types, default_sample_type: self.string(self.default_sample_type)?, samples })
    }

    fn sample(&self, message: &[u8], located: &mut HashMap<u64, Vec<Frame>>) -> Result<Sample, PprofError> {
        let mut sample = Sample { values: Vec::new(), frames: Vec::new(), stack_id: None };
        for entry in Reader::new(message) {
            match entry? {
                (field::sample::LOCATION_ID, value) => {
                    for id in value.ints()? {
                        let frames = match located.entry(id) {
                            Entry::Occupied(known) => known.into_mut(),
                            Entry::Vacant(new) => new.insert(self.frames(id)?),
                        };
                        if sample.frames.len() + frames.len() > MAX_SAMPLE_FRAMES {
                            return Err(PprofError::TooDeep);
                        }
                        sample.frames.extend(frames.iter().cloned());
                    }
                }
                (field::sample::VALUE, value) => sample.values.extend(value.ints()?),
                (field::sample::LABEL, value) => {
                    let label = ints(value.bytes()?)?;
                    let get = |n| label.get(&n).copied().unwrap_or(0);
                    if self.string(get(field::label::KEY))? == STACK_ID_LABEL {
                        sample.stack_id = Some(self.string(get(field::label::STR))?);
                    }
                }
                _ => {}
            }
        }
        if sample.values.len() != self.sample_types.len() {
            return Err(PprofError::Malformed("a sample has not one value per sample type"));
        }
        Ok(sample)
    }

    /// The frames of location `id`: one per line, the last the function they are inlined into;
    /// `module+0xoffset` for a location without lines.
    fn frames(&self, id: u64) -> Result<Vec<Frame>, PprofError> {
        let mut frames = Vec::new();
        let RawLocation { mapping, address, lines } =
            self.locations.get(&id).ok_or(PprofError::Malformed("a sample names a location that is not there"))?;
        if lines.len() > MAX_SAMPLE_FRAMES {
            return Err(PprofError::TooDeep);
        }
        let (module, start, offset) = match self.mappings.get(mapping) {
            Some(&(filename, start, offset)) => (self.string(filename)?, start, offset),
            None => (String::new(), 0, 0),
        };
        let frame = |function: String, file: String, line: u64, inlined| {
            Frame::new(FrameInfo {
                address: format!("{address:#x}"),
                function: capped(&function),
                file: (!file.is_empty()).then(|| capped(&file)),
                line: u32::try_from(line).ok().filter(|&l| l > 0),
                module: capped(&module),
                inlined,
                mangled: None,
            })
        };
        if lines.is_empty() {
            let name = module.rsplit('/').next().unwrap_or(&module);
            let file_offset = address.wrapping_sub(start).wrapping_add(offset);
            frames.push(frame(format!("{name}+{file_offset:#x}"), String::new(), 0, false));
        }
        for (i, &(function, line)) in lines.iter().enumerate() {
            let (name, file) = self
                .functions
                .get(&function)
                .ok_or(PprofError::Malformed("a line names a function that is not there"))?;
            let name = self.string(*name)?;
            if name == NO_STACK && *address == 0 {
                continue;
            }
            frames.push(frame(name, self.string(*file)?, line, i + 1 < lines.len()));
        }
        Ok(frames)
    }
}
