//! A recording (`--record FILE`): everything the reports of a session need, in one file written
//! as the session goes, so that `memprof report FILE` renders any format later, elsewhere.
//!
//! The file is a line naming the format, then records, each framed as
//! `[payload length: u32 LE][CRC-32 of the payload: u32 LE][payload]`, the payload a deflated
//! JSON `Record`. Every record is on disk (`fsync`) before the session goes on, so a memprof
//! killed (SIGKILL, a lost machine) leaves every interval before the kill readable; the reader
//! stops at the first record that is cut short or does not match its checksum, and says so.
//!
//! Each interval's record is the session's report in full (every stack, the freed ones too, and
//! double frees), from which `format::select` takes what each format shows, as the live session
//! does; and every stack held at the peak, for `memprof report --at peak`. A stack's frames are
//! stored once, in the record where the stack first appears, as numbers in the file's table of
//! frames; each frame is stored once, in the record where it first appears. Stacks share most
//! of their frames: the 65,536 stacks of `tests/fixtures/many_stacks.c`, of 122 frames each,
//! have 11 distinct frames. Format 1 stored each stack's frames whole; it is still read.

use std::{
    collections::{HashMap, HashSet},
    io::Read,
    path::{Path, PathBuf},
};

use flate2::{read::DeflateDecoder, write::DeflateEncoder, Compression, Crc};
use serde::{Deserialize, Serialize};

use crate::{
    commands::output::ReportFile,
    heap::report::Report,
    process::memory,
    symbolize::{Frame, Frames},
};

/// The file's first line: what it is, and the version of its records.
const MAGIC: &[u8] = b"memprof recording 2\n";
/// The first line of format 1, whose stacks hold their frames whole.
const MAGIC_1: &[u8] = b"memprof recording 1\n";

/// The JSON given to the deflater at once.
const JSON_CHUNK: usize = 64 << 10;

/// The largest record read: a report of 64 Ki stacks of 127 frames, each frame a number, is far
/// less.
const MAX_RECORD: u32 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("cannot write the recording {path}: {cause}; {}", crate::error::write_fix(.cause, "--record"))]
    Write { path: PathBuf, cause: std::io::Error },
    #[error("cannot read the recording {path}: {cause}; check the path")]
    Read { path: PathBuf, cause: std::io::Error },
    #[error("{path} is not a memprof recording (one is made by `memprof attach` or `run` with --record FILE)")]
    NotARecording { path: PathBuf },
    #[error("{path} is a recording of format {version}, made by a newer memprof than this one (format 2); render it with that memprof")]
    Newer { path: PathBuf, version: String },
    #[error("{path} is a recording memprof cannot read: {detail}; render it with the memprof version that made it")]
    Unreadable { path: PathBuf, detail: String },
    #[error("{path} holds no complete interval (the session ended before its first report); record for longer than one --interval")]
    NoInterval { path: PathBuf },
    #[error("{path} is damaged before its first complete interval: {detail}; nothing in it can be shown")]
    Damaged { path: PathBuf, detail: String },
    #[error("{path}: its records inflate to more than {} MiB in memory, a quarter of the {room}; read it where more memory is free", budget >> 20)]
    TooLarge { path: PathBuf, budget: u64, room: memory::Room },
}

/// What the session was asked for: how `memprof report` renders by default.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// `--top`: stacks per report in the table.
    pub top: usize,
    /// `--interval`, in seconds.
    pub interval_s: f64,
}

/// One record of the file.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Record {
    /// The first record.
    Start { settings: Settings },
    /// An interval's report (`report.final` false), or the final one.
    Report {
        report: Box<Report>,
        /// The frames that appear for the first time, numbered on from the file's last.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        new_frames: Vec<Frame>,
        /// The frames of the stacks that appear for the first time; the report's stacks have
        /// theirs taken out.
        new_stacks: Vec<SavedStack>,
    },
}

/// A stack's frames, by process (a forked child's addresses are its parent's, an exec'd one's
/// are not) and stack id.
#[derive(Debug, Serialize, Deserialize)]
struct SavedStack {
    pid: u32,
    stack_id: String,
    /// Their numbers in the file's table of frames.
    #[serde(default)]
    frame_numbers: Vec<u32>,
    /// Format 1's: the frames whole.
    #[serde(default, skip_serializing)]
    frames: Frames,
}

/// Writes a recording as the session goes.
pub struct RecordingWriter {
    file: ReportFile,
    path: PathBuf,
    /// The (pid, stack id) of the stacks whose frames are in the file.
    saved: HashSet<(u32, String)>,
    /// The numbers of the frames in the file.
    frame_numbers: HashMap<Frame, u32>,
}

impl RecordingWriter {
    /// Opens the file beside `path` (it replaces `path` with its first record, as report files
    /// do: a session that never starts leaves an older file as it was).
    pub fn create(path: &Path) -> Result<Self, RecordingError> {
        let file =
            ReportFile::create(path).map_err(|cause| RecordingError::Write { path: path.to_path_buf(), cause })?;
        Ok(Self { file, path: path.to_path_buf(), saved: HashSet::new(), frame_numbers: HashMap::new() })
    }

    pub fn start(&mut self, settings: Settings) -> Result<(), RecordingError> {
        let mut bytes = MAGIC.to_vec();
        frame(&Record::Start { settings }, &mut bytes);
        self.append(&bytes)
    }

    /// Appends `report` (and its children's), on disk when this returns. The stacks and frames
    /// it stores are known to be in the file only once it is: a record taken back (a full disk)
    /// leaves them to the next.
    pub fn report(&mut self, report: &Report) -> Result<(), RecordingError> {
        let mut report = report.clone();
        let (mut new_frames, mut new_stacks) = (Vec::new(), Vec::new());
        let (mut saving, mut numbered) = (HashSet::new(), HashMap::new());
        report.for_each_process(&mut |process| {
            let pid = process.pid;
            for (stack_id, frames) in stack_frames(process) {
                let frames = std::mem::take(frames);
                let key = (pid, stack_id.clone());
                if frames.is_empty() || self.saved.contains(&key) || !saving.insert(key) {
                    continue;
                }
                let frame_numbers = (frames.iter())
                    .map(|frame| match self.frame_numbers.get(frame).or_else(|| numbered.get(frame)) {
                        Some(&known) => known,
                        None => {
                            let next = (self.frame_numbers.len() + numbered.len()) as u32;
                            numbered.insert(frame.clone(), next);
                            new_frames.push(frame.clone());
                            next
                        }
                    })
                    .collect();
                new_stacks.push(SavedStack {
                    pid,
                    stack_id: stack_id.clone(),
                    frame_numbers,
                    frames: Frames::default(),
                });
            }
        });
        let mut bytes = Vec::new();
        frame(&Record::Report { report: Box::new(report), new_frames, new_stacks }, &mut bytes);
        self.append(&bytes)?;
        self.saved.extend(saving);
        self.frame_numbers.extend(numbered);
        Ok(())
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), RecordingError> {
        self.file.append(bytes).map_err(|cause| RecordingError::Write { path: self.path.clone(), cause })
    }
}

/// The id and frames of each stack `process` lists: its stacks, and those held at the peak or
/// with temporary allocations (most hold nothing now, so the stacks do not list them).
fn stack_frames(process: &mut Report) -> impl Iterator<Item = (&String, &mut Frames)> {
    let stacks = process.stacks.iter_mut().map(|s| (&s.stack_id, &mut s.frames));
    let peak = process.peak.stacks.iter_mut().map(|s| (&s.stack_id, &mut s.frames));
    let temporary = process.temporary_stacks.iter_mut().map(|s| (&s.stack_id, &mut s.frames));
    stacks.chain(peak).chain(temporary)
}

/// Appends `record` to `out`, framed (see the module's documentation).
fn frame(record: &impl Serialize, out: &mut Vec<u8>) {
    let mut deflate = DeflateEncoder::new(Vec::new(), Compression::default());
    // Buffered: serde_json writes token by token, and each write to the encoder costs a pass over
    // its whole output buffer, which made a recording's writes take seconds of CPU.
    let mut json = std::io::BufWriter::with_capacity(JSON_CHUNK, &mut deflate);
    serde_json::to_writer(&mut json, record).expect("a record always serializes into memory");
    json.into_inner().expect("writing to memory cannot fail");
    let payload = deflate.finish().expect("writing to memory cannot fail");
    let mut crc = Crc::new();
    crc.update(&payload);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&payload);
}

/// A recording read back.
#[derive(Debug)]
pub struct Recording {
    pub settings: Settings,
    /// Every report in the order the session wrote them: the intervals', then the final one.
    pub reports: Vec<Report>,
    /// Why the file ends before a final report, when it does: cut short (memprof was killed),
    /// or damaged.
    pub ended_early: Option<String>,
}

impl Recording {
    /// Reads the recording at `path`, its inflated records within a quarter of the memory
    /// memprof may use: a small file can inflate to gigabytes.
    pub fn read(path: &Path) -> Result<Self, RecordingError> {
        let room = memory::room();
        let budget = room.bytes / 4;
        let bytes = Self::read_file(path, budget)?;
        Self::parse(&bytes, budget).map_err(|problem| match problem {
            Problem::NotARecording => RecordingError::NotARecording { path: path.to_path_buf() },
            Problem::Unreadable(detail) => RecordingError::Unreadable { path: path.to_path_buf(), detail },
            Problem::NoInterval => RecordingError::NoInterval { path: path.to_path_buf() },
            Problem::Damaged(detail) => RecordingError::Damaged { path: path.to_path_buf(), detail },
            Problem::OverBudget => RecordingError::TooLarge { path: path.to_path_buf(), budget, room },
        })
    }

    /// The file's bytes: its first ones must be a recording's, and no more than `budget` of them
    /// are read (what they inflate to is more), so that `/dev/zero` is refused at once.
    fn read_file(path: &Path, budget: u64) -> Result<Vec<u8>, RecordingError> {
        use std::io::Read as _;
        let read = |cause| RecordingError::Read { path: path.to_path_buf(), cause };
        let mut file = std::fs::File::open(path).map_err(read)?;
        let mut start = vec![0; MAGIC.len()];
        let whole = file.read_exact(&mut start).is_ok();
        if !whole || (start != MAGIC && start != MAGIC_1) {
            return Err(match newer_version(&start, &mut file) {
                Some(version) => RecordingError::Newer { path: path.to_path_buf(), version },
                None => RecordingError::NotARecording { path: path.to_path_buf() },
            });
        }
        file.take(budget.saturating_add(1)).read_to_end(&mut start).map_err(read)?;
        if start.len() as u64 > budget {
            return Err(RecordingError::TooLarge { path: path.to_path_buf(), budget, room: memory::room() });
        }
        Ok(start)
    }

    /// `budget`: the inflated bytes of all records together that may be read.
    fn parse(bytes: &[u8], mut budget: u64) -> Result<Self, Problem> {
        let mut rest =
            bytes.strip_prefix(MAGIC).or_else(|| bytes.strip_prefix(MAGIC_1)).ok_or(Problem::NotARecording)?;
        let mut settings = None;
        let mut reports = Vec::new();
        let mut table: Vec<Frame> = Vec::new();
        let mut frames: HashMap<(u32, String), Frames> = HashMap::new();
        let mut ended_early = None;
        'records: while !rest.is_empty() {
            let payload = match next_payload(&mut rest) {
                Ok(payload) => payload,
                Err(end) => {
                    ended_early = Some(end);
                    break;
                }
            };
            // Parsed as it inflates: a record's JSON is never held whole.
            let limit = budget.min(u64::from(MAX_RECORD));
            let mut inflated = Capped { inner: DeflateDecoder::new(payload), left: limit, over: false };
            let parsed = serde_json::from_reader(std::io::BufReader::new(&mut inflated));
            if inflated.over {
                return Err(if limit == budget {
                    Problem::OverBudget
                } else {
                    Problem::Unreadable(format!("a record inflates to more than {} MiB", MAX_RECORD >> 20))
                });
            }
            budget -= limit - inflated.left;
            let record: Record =
                parsed.map_err(|err| Problem::Unreadable(format!("a record is not one this memprof knows: {err}")))?;
            match record {
                Record::Start { settings: start } => settings = Some(start),
                Record::Report { mut report, new_frames, new_stacks } => {
                    // What the record takes in memory past its JSON: each frame and each stack a
                    // struct of their own, more than their text where names are short, and a
                    // pointer for each frame of a stack.
                    let whole = new_stacks.iter().map(|stack| stack.frames.len() as u64).sum::<u64>();
                    let numbered = new_stacks.iter().map(|stack| stack.frame_numbers.len() as u64).sum::<u64>();
                    let mut structs = (whole + new_frames.len() as u64) * FRAME_BYTES + numbered * FRAME_REF_BYTES;
                    report.for_each_process(&mut |process| structs += process.stacks.len() as u64 * STACK_BYTES);
                    budget = budget.checked_sub(structs).ok_or(Problem::OverBudget)?;
                    table.extend(new_frames);
                    let mut listed = Vec::with_capacity(new_stacks.len());
                    for stack in new_stacks {
                        let stack_frames = if stack.frame_numbers.is_empty() {
                            Some(stack.frames)
                        } else {
                            stack.frame_numbers.iter().map(|&number| table.get(number as usize).cloned()).collect()
                        };
                        let Some(stack_frames) = stack_frames else {
                            // Checksums pass, so only an edited file or a writer's fault: the
                            // reports before it are shown.
                            ended_early = Some(End::Damaged("a stack names a frame no record holds".into()));
                            break 'records;
                        };
                        listed.push(((stack.pid, stack.stack_id), stack_frames));
                    }
                    frames.extend(listed);
                    report.for_each_process(&mut |process| {
                        let pid = process.pid;
                        for (stack_id, stack_frames) in stack_frames(process) {
                            if let Some(known) = frames.get(&(pid, stack_id.clone())) {
                                *stack_frames = known.clone();
                            }
                        }
                    });
                    reports.push(*report);
                }
            }
        }
        if let (true, Some(End::Damaged(why))) = (reports.is_empty(), &ended_early) {
            return Err(Problem::Damaged(why.clone()));
        }
        let settings = settings.ok_or(Problem::NoInterval)?;
        if reports.is_empty() {
            return Err(Problem::NoInterval);
        }
        let ended_early = match ended_early {
            Some(end) => Some(end.to_string()),
            None if !reports.last().is_some_and(|r| r.is_final) => Some(
                "it ends before the final report (memprof was killed, its disk filled, or it is still recording)"
                    .to_string(),
            ),
            None => None,
        };
        Ok(Self { settings, reports, ended_early })
    }
}

/// A frame and a stack in memory, besides their text (see `Recording::parse`'s budget).
const FRAME_BYTES: u64 = (std::mem::size_of::<crate::symbolize::FrameInfo>() + 16) as u64;
const STACK_BYTES: u64 = std::mem::size_of::<crate::heap::report::StackReport>() as u64;
const FRAME_REF_BYTES: u64 = std::mem::size_of::<Frame>() as u64;

/// The format a later memprof's recording names on its first line (`memprof recording 2`), whose
/// first bytes `start` are; None for a file that is no recording.
fn newer_version(start: &[u8], file: &mut std::fs::File) -> Option<String> {
    let prefix = &MAGIC[..MAGIC.len() - 2];
    let mut line = start.strip_prefix(prefix)?.to_vec();
    // A longer number than this memprof's one digit: read to the line's end, a few bytes.
    let mut byte = [0];
    while !line.ends_with(b"\n") && line.len() < 12 && file.read(&mut byte).ok()? == 1 {
        line.push(byte[0]);
    }
    let version = std::str::from_utf8(line.strip_suffix(b"\n")?).ok()?;
    (version.parse::<u32>().ok()? > 2).then(|| version.to_string())
}

/// A reader that gives at most `left` bytes and fails, setting `over`, when there are more.
struct Capped<R> {
    inner: R,
    left: u64,
    over: bool,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            if self.inner.read(&mut [0])? > 0 {
                self.over = true;
                return Err(std::io::Error::other("more than memprof reads"));
            }
            return Ok(0);
        }
        let room = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let read = self.inner.read(&mut buf[..room])?;
        self.left -= read as u64;
        Ok(read)
    }
}

enum Problem {
    NotARecording,
    Unreadable(String),
    NoInterval,
    /// Damaged before any report could be read.
    Damaged(String),
    /// The records, inflated and held as stacks and frames, take more than the budget.
    OverBudget,
}

/// Why a recording's records end before the file does.
#[derive(Debug, thiserror::Error)]
enum End {
    #[error("its last record is cut short (memprof was killed or its disk filled while writing it, or it is still writing it)")]
    Cut,
    #[error("{0}: the file is damaged there")]
    Damaged(String),
}

/// The next record's payload, checked; or why the file ends here.
fn next_payload<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], End> {
    if rest.len() < 8 {
        return Err(End::Cut);
    }
    let length = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
    let sum = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
    if length > MAX_RECORD {
        return Err(End::Damaged(format!("a record claims {length} bytes")));
    }
    let Some(payload) = rest.get(8..8 + length as usize) else { return Err(End::Cut) };
    let mut crc = Crc::new();
    crc.update(payload);
    if crc.sum() != sum {
        return Err(End::Damaged("a record does not match its checksum".to_string()));
    }
    *rest = &rest[8 + length as usize..];
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::{samples, PeakStack, TemporaryStack};

    fn recording(reports: &[Report]) -> Vec<u8> {
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("memprof-recording-test-{}-{n}.rec", std::process::id()));
        let mut writer = RecordingWriter::create(&path).unwrap();
        writer.start(Settings { top: 3, interval_s: 0.5 }).unwrap();
        for report in reports {
            writer.report(report).unwrap();
        }
        drop(writer);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        bytes
    }

    fn json(report: &Report) -> serde_json::Value {
        serde_json::to_value(report).unwrap()
    }

    #[test]
    fn reports_read_back_as_written_with_frames_stored_once() {
        let mut interval = samples::report();
        interval.is_final = false;
        let last = samples::report();
        let bytes = recording(&[interval.clone(), last.clone()]);
        let read = Recording::parse(&bytes, u64::MAX).ok().unwrap();
        assert_eq!(read.settings.top, 3);
        assert_eq!(read.reports.iter().map(json).collect::<Vec<_>>(), [json(&interval), json(&last)]);
        assert!(read.ended_early.is_none());
        let text = String::from_utf8_lossy(&bytes);
        assert!(!text.contains("leak_here"), "deflated");
    }

    #[test]
    fn frames_at_the_peak_and_of_temporary_allocations_are_stored_once_too() {
        let mut interval = samples::report();
        interval.is_final = false;
        let listed = interval.stacks[0].clone();
        let mut gone = listed.clone();
        gone.stack_id = "01".into();
        gone.frames = vec![samples::frame("freed_since", None, None)].into();
        interval.peak.stacks = [&listed, &gone]
            .map(|s| PeakStack { stack_id: s.stack_id.clone(), bytes: 10, frames: s.frames.clone() })
            .into();
        interval.temporary_stacks = vec![TemporaryStack {
            stack_id: "01".into(),
            temporary_allocations: 1,
            allocations: 1,
            frames: gone.frames,
        }];
        let bytes = recording(&[interval.clone(), interval.clone()]);
        let read = Recording::parse(&bytes, u64::MAX).ok().unwrap();
        assert_eq!(read.reports.iter().map(json).collect::<Vec<_>>(), [json(&interval), json(&interval)]);
        let mut rest = &bytes[MAGIC.len()..];
        let records: Vec<String> = std::iter::from_fn(|| next_payload(&mut rest).ok())
            .map(|payload| std::io::read_to_string(DeflateDecoder::new(payload)).unwrap())
            .collect();
        assert_eq!(records.len(), 3);
        for function in ["leak_here", "freed_since"] {
            assert_eq!(records[1].matches(function).count(), 1, "{function} in {}", records[1]);
            assert!(!records[2].contains(function), "the second report repeats no frames: {}", records[2]);
        }
    }

    #[test]
    fn stacks_that_share_frames_store_each_frame_once() {
        let mut report = samples::report();
        let mut other = report.stacks[0].clone();
        other.stack_id = "02".into();
        let frames = [samples::frame("other_leaf", None, None)].into_iter().chain(other.frames.iter().cloned());
        other.frames = frames.collect();
        report.stacks.push(other);
        let bytes = recording(&[report.clone()]);
        let read = Recording::parse(&bytes, u64::MAX).ok().unwrap();
        assert_eq!(read.reports.iter().map(json).collect::<Vec<_>>(), [json(&report)]);
        let mut rest = &bytes[MAGIC.len()..];
        let records: Vec<String> = std::iter::from_fn(|| next_payload(&mut rest).ok())
            .map(|payload| std::io::read_to_string(DeflateDecoder::new(payload)).unwrap())
            .collect();
        assert_eq!(records[1].matches("leak_here").count(), 1, "{}", records[1]);
    }

    #[test]
    fn a_recording_of_format_1_is_read() {
        let report = samples::report();
        let mut saved = report.clone();
        let stack = &mut saved.stacks[0];
        let frames = std::mem::take(&mut stack.frames);
        let mut bytes = MAGIC_1.to_vec();
        frame(&Record::Start { settings: Settings { top: 3, interval_s: 0.5 } }, &mut bytes);
        // Format 1 wrote each stack's frames whole, under `frames`.
        let record = serde_json::json!({
            "kind": "report",
            "report": saved,
            "new_stacks": [{ "pid": saved.pid, "stack_id": saved.stacks[0].stack_id, "frames": frames }],
        });
        frame(&record, &mut bytes);
        let read = Recording::parse(&bytes, u64::MAX).ok().unwrap();
        assert_eq!(read.reports.iter().map(json).collect::<Vec<_>>(), [json(&report)]);
    }

    #[test]
    fn a_stack_naming_a_frame_no_record_holds_ends_the_recording_there() {
        let mut interval = samples::report();
        interval.is_final = false;
        let mut bytes = recording(&[interval.clone()]);
        let mut later = samples::report();
        later.stacks[0].stack_id = "later".into();
        let mut saved = later.clone();
        saved.stacks[0].frames = Frames::default();
        let new_stacks = vec![SavedStack {
            pid: saved.pid,
            stack_id: "later".into(),
            frame_numbers: vec![99],
            frames: Frames::default(),
        }];
        frame(&Record::Report { report: Box::new(saved), new_frames: vec![], new_stacks }, &mut bytes);
        let read = Recording::parse(&bytes, u64::MAX).ok().unwrap();
        assert_eq!(read.reports.iter().map(json).collect::<Vec<_>>(), [json(&interval)]);
        assert!(read.ended_early.unwrap().contains("a stack names a frame no record holds"));
    }

    #[test]
    fn a_file_cut_anywhere_reads_up_to_its_last_whole_record() {
        let mut interval = samples::report();
        interval.is_final = false;
        let bytes = recording(&[interval.clone(), interval.clone(), samples::report()]);
        for cut in 0..bytes.len() {
            match Recording::parse(&bytes[..cut], u64::MAX) {
                Ok(read) => {
                    assert!(read.reports.len() < 3, "cut at {cut}");
                    assert!(read.ended_early.is_some(), "cut at {cut}");
                    assert!(read.reports.iter().all(|r| !r.is_final && r.stacks[0].frames.len() == 1));
                }
                Err(Problem::NotARecording | Problem::NoInterval) => {}
                Err(Problem::Damaged(why)) => panic!("cut at {cut}: {why}"),
                Err(Problem::Unreadable(why)) => panic!("cut at {cut}: {why}"),
                Err(Problem::OverBudget) => panic!("cut at {cut}: over no budget"),
            }
        }
    }

    #[test]
    fn a_damaged_record_ends_the_recording_there() {
        let mut interval = samples::report();
        interval.is_final = false;
        let mut bytes = recording(&[interval.clone(), samples::report()]);
        let last = bytes.len() - 3;
        bytes[last] ^= 0xff;
        let read = Recording::parse(&bytes, u64::MAX).ok().unwrap();
        assert_eq!(read.reports.len(), 1);
        assert!(read.ended_early.unwrap().contains("checksum"));
        // A byte of the first report's payload, after the start record.
        let mut rest = &bytes[MAGIC.len()..];
        next_payload(&mut rest).unwrap();
        let first = bytes.len() - rest.len() + 10;
        bytes[first] ^= 0xff;
        let Err(Problem::Damaged(why)) = Recording::parse(&bytes, u64::MAX) else { panic!("a damaged first report") };
        assert_eq!(why, "a record does not match its checksum");
        assert!(matches!(Recording::parse(b"{\"final\": true}", u64::MAX), Err(Problem::NotARecording)));
    }

    #[test]
    fn records_that_inflate_past_the_budget_are_refused() {
        let mut interval = samples::report();
        interval.is_final = false;
        let bytes = recording(&[interval, samples::report()]);
        let mut rest = &bytes[MAGIC.len()..];
        let mut inflated = 0;
        while let Ok(payload) = next_payload(&mut rest) {
            inflated += std::io::copy(&mut DeflateDecoder::new(payload), &mut std::io::sink()).unwrap();
        }
        // Each stack of each report, each distinct frame once, and each stack's pointer to each of
        // its frames, counted beside the text.
        let report = samples::report();
        let frames: Vec<&Frame> = report.stacks.iter().flat_map(|stack| stack.frames.iter()).collect();
        let distinct = frames.iter().collect::<HashSet<_>>().len() as u64;
        let structs = 2 * report.stacks.len() as u64 * STACK_BYTES
            + distinct * FRAME_BYTES
            + frames.len() as u64 * FRAME_REF_BYTES;
        assert!(Recording::parse(&bytes, inflated + structs).is_ok());
        assert!(matches!(Recording::parse(&bytes, inflated + structs - 1), Err(Problem::OverBudget)));
    }
}
