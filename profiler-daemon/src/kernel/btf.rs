//! Field offsets of kernel structures, read from the kernel's BTF (`/sys/kernel/btf/vmlinux`):
//! the BPF programs read `task_struct` fields at offsets the daemon gives them, since Rust BPF
//! programs have no CO-RE relocations and the layout differs between kernel builds.
//!
//! Only what finding a struct member needs is parsed: the header, the string section, and each
//! type's size, to step over it (the BTF format: linux/Documentation/bpf/btf.rst).

use std::collections::HashMap;

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("reading {path}: {cause}")]
    Read { path: &'static str, cause: std::io::Error },
    #[error("the kernel's BTF is malformed: {0}")]
    Malformed(&'static str),
    #[error("the kernel's BTF has no struct {0} with the members memprof reads")]
    Missing(String),
}

const VMLINUX: &str = "/sys/kernel/btf/vmlinux";
const MAGIC: u16 = 0xeb9f;

/// The running kernel's BTF, read and indexed once for all the structures memprof reads.
pub struct KernelBtf {
    data: Vec<u8>,
    sections: Sections,
    starts: Vec<usize>,
}

impl KernelBtf {
    pub fn read() -> Result<Self, BtfError> {
        let data = std::fs::read(VMLINUX).map_err(|cause| BtfError::Read { path: VMLINUX, cause })?;
        Self::parse(data)
    }

    fn parse(data: Vec<u8>) -> Result<Self, BtfError> {
        let sections = Sections::of(&data)?;
        let starts = starts(sections.types(&data))?;
        Ok(Self { data, sections, starts })
    }

    /// Byte offsets of the members named in `members` of struct `name`.
    pub fn member_offsets(&self, name: &str, members: &[&str]) -> Result<Vec<u32>, BtfError> {
        let btf = Types {
            types: self.sections.types(&self.data),
            strings: self.sections.strings(&self.data),
            starts: &self.starts,
        };
        for index in 0..btf.starts.len() {
            let (name_off, kind, _) = btf.header(index)?;
            if kind == STRUCT && btf.string(name_off) == name.as_bytes() {
                let mut found = HashMap::new();
                btf.members(index, 0, &mut found)?;
                if let Some(offsets) = members.iter().map(|m| found.get(m.as_bytes()).copied()).collect() {
                    return Ok(offsets);
                }
            }
        }
        Err(BtfError::Missing(name.to_string()))
    }
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, BtfError> {
    data.get(at..at + 4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("four bytes")))
        .ok_or(BtfError::Malformed("truncated"))
}

/// Where the type and string sections are in the data, checked to be inside it.
struct Sections {
    types: std::ops::Range<usize>,
    strings: std::ops::Range<usize>,
}

impl Sections {
    fn of(data: &[u8]) -> Result<Self, BtfError> {
        if data.len() < 24 || u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            return Err(BtfError::Malformed("bad magic"));
        }
        let header_len = u32_at(data, 4)? as usize;
        let (type_off, type_len) = (u32_at(data, 8)? as usize, u32_at(data, 12)? as usize);
        let (str_off, str_len) = (u32_at(data, 16)? as usize, u32_at(data, 20)? as usize);
        let types = header_len + type_off..header_len + type_off + type_len;
        let strings = header_len + str_off..header_len + str_off + str_len;
        data.get(types.clone()).ok_or(BtfError::Malformed("types"))?;
        data.get(strings.clone()).ok_or(BtfError::Malformed("strings"))?;
        Ok(Self { types, strings })
    }

    fn types<'a>(&self, data: &'a [u8]) -> &'a [u8] {
        &data[self.types.clone()]
    }

    fn strings<'a>(&self, data: &'a [u8]) -> &'a [u8] {
        &data[self.strings.clone()]
    }
}

const STRUCT: u32 = 4;
const UNION: u32 = 5;

/// Where each type starts in the type section, in id order from id 1 (id 0 is void).
fn starts(types: &[u8]) -> Result<Vec<usize>, BtfError> {
    let mut starts = Vec::new();
    let mut at = 0;
    while at + 12 <= types.len() {
        starts.push(at);
        let info = u32_at(types, at + 4)?;
        let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
        // Bytes after the 12-byte common part, by kind.
        at += 12
            + match kind {
                1 | 14 | 17 => 4,              // int, var, decl tag
                3 => 12,                       // array
                4 | 5 | 15 | 19 => 12 * vlen,  // struct, union, datasec, enum64
                6 | 13 => 8 * vlen,            // enum, func proto
                0 | 2 | 7..=12 | 16 | 18 => 0, // void, ptr, fwd, typedef, qualifiers, func, float, type tag
                _ => return Err(BtfError::Malformed("unknown type kind")),
            };
    }
    Ok(starts)
}

/// The type section, indexed.
struct Types<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    starts: &'a [usize],
}

impl<'a> Types<'a> {
    fn string(&self, offset: u32) -> &'a [u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    /// The name offset, kind and info word of the type at `index` (type id `index + 1`).
    fn header(&self, index: usize) -> Result<(u32, u32, u32), BtfError> {
        let at = *self.starts.get(index).ok_or(BtfError::Malformed("type id out of range"))?;
        let info = u32_at(self.types, at + 4)?;
        Ok((u32_at(self.types, at)?, (info >> 24) & 0x1f, info))
    }

    /// Adds the members of the struct or union at `index`, placed at `base` bytes, to `found`;
    /// those of an anonymous struct or union member as its parent's, as C reaches them
    /// (`mm_struct` keeps nearly all its members in one).
    fn members(&self, index: usize, base: u32, found: &mut HashMap<&'a [u8], u32>) -> Result<(), BtfError> {
        let (_, _, info) = self.header(index)?;
        let (vlen, kind_flag) = ((info & 0xffff) as usize, info >> 31);
        for member in 0..vlen {
            let entry = self.starts[index] + 12 + 12 * member;
            let (name_off, type_id, bits) =
                (u32_at(self.types, entry)?, u32_at(self.types, entry + 4)?, u32_at(self.types, entry + 8)?);
            // With kind_flag the low 24 bits are the offset and the high 8 a bitfield's size.
            let bit_offset = if kind_flag != 0 { bits & 0xff_ffff } else { bits };
            let offset = base + bit_offset / 8;
            let name = self.string(name_off);
            let member_index = (type_id as usize).wrapping_sub(1);
            if name.is_empty() && matches!(self.header(member_index)?.1, STRUCT | UNION) {
                self.members(member_index, offset, found)?;
            } else {
                found.insert(name, offset);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_task_struct_pid_and_tgid_in_the_running_kernel() {
        let offsets = KernelBtf::read().unwrap().member_offsets("task_struct", &["pid", "tgid"]).unwrap();
        assert_eq!(offsets[1], offsets[0] + 4, "tgid follows pid: {offsets:?}");
    }

    #[test]
    fn finds_a_member_of_an_anonymous_struct() {
        let offsets = KernelBtf::read().unwrap().member_offsets("mm_struct", &["uprobes_state"]).unwrap();
        assert!(offsets[0] > 0, "{offsets:?}");
    }

    #[test]
    fn refuses_what_is_not_btf() {
        assert!(matches!(KernelBtf::parse(vec![0; 64]), Err(BtfError::Malformed(_))));
    }
}
