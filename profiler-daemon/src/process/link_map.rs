//! A process's mappings from its dynamic linker's list of loaded objects (each one's path and load
//! bias, read in the process by the probe at `_dl_debug_state`) and the files' program headers, as
//! a debugger finds them: what memprof knows of a short-lived process that was gone before it
//! could read `/proc/PID/maps`.

use std::{fs, os::unix::fs::MetadataExt as _, path::Path};

use object::{
    read::elf::{ElfFile, FileHeader, ProgramHeader as _},
    Object as _, ObjectSegment as _,
};

use super::{mounts::MemprofsView, procfs::FileMapping};

/// The mappings of `objects` (load bias and path; an empty path is the executable, `exe`).
pub fn mappings(objects: &[(u64, String)], exe: Option<&str>) -> Vec<FileMapping> {
    // The process is gone: its list's paths are looked at in memprof's own mounts.
    let view = MemprofsView::read();
    let mut mappings: Vec<FileMapping> = objects
        .iter()
        .filter_map(|(base, name)| match name.is_empty() {
            // By the name memprof knows it by, as `procfs::file_mappings` names it (a link's,
            // when the program was started by one: see `procfs::exe_path`).
            true => object_mappings(*base, exe?, exe?, &view),
            false => object_mappings(*base, name, &own_path(name), &view),
        })
        .flatten()
        .collect();
    mappings.sort_by_key(|m| m.start);
    mappings
}

/// The mappings of a static executable loaded at the addresses it names (not
/// position-independent), which has no dynamic linker to report them and needs none; None for
/// any other file. A dynamically linked one's libraries are not in its file: the list the
/// kernel has knows more of them than its mappings alone would.
pub fn fixed_executable(exe: &str) -> Option<Vec<FileMapping>> {
    let view = MemprofsView::read();
    if !view.may_look(Path::new(exe)) {
        return None;
    }
    let data = super::elf_bytes::read_path(Path::new(exe)).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let fixed = file.kind() == object::ObjectKind::Executable && !names_interpreter(&file);
    fixed.then(|| object_mappings(0, exe, exe, &view)).flatten()
}

/// Whether an ELF file names a dynamic linker (`PT_INTERP`), by its program headers, which the
/// loader reads (a file may have no section headers).
fn names_interpreter(file: &object::File) -> bool {
    fn in_headers<Elf: FileHeader>(elf: &ElfFile<Elf>) -> bool {
        let endian = elf.endian();
        elf.elf_program_headers().iter().any(|header| header.p_type(endian) == object::elf::PT_INTERP)
    }
    match file {
        object::File::Elf32(elf) => in_headers(elf),
        object::File::Elf64(elf) => in_headers(elf),
        _ => false,
    }
}

/// A library's own path, as /proc/PID/maps names it, not the link the loader opened it by
/// (`/lib` is a link to `/usr/lib` on merged-/usr systems).
fn own_path(path: &str) -> String {
    fs::canonicalize(path).map_or_else(|_| path.to_string(), |p| p.to_string_lossy().into_owned())
}

/// One mapping per loadable segment of the file at `path`, page-aligned as the loader maps them,
/// and `named`.
fn object_mappings(base: u64, path: &str, named: &str, view: &MemprofsView) -> Option<Vec<FileMapping>> {
    const PF_X: u32 = 1;
    const PAGE: u64 = 4096;
    if !view.may_look(Path::new(path)) {
        return None;
    }
    let meta = fs::metadata(path).ok()?;
    let data = super::elf_bytes::read_path(Path::new(path)).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let device = format!("{:02x}:{:02x}", libc::major(meta.dev()), libc::minor(meta.dev()));
    let segments = file.segments().filter_map(|segment| {
        let object::SegmentFlags::Elf { p_flags } = segment.flags() else { return None };
        let (offset, _) = segment.file_range();
        let start = base.wrapping_add(segment.address() & !(PAGE - 1));
        let end = base.wrapping_add((segment.address() + segment.size()).next_multiple_of(PAGE));
        Some(FileMapping {
            start,
            end,
            offset: offset & !(PAGE - 1),
            path: named.to_string(),
            executable: p_flags & PF_X != 0,
            device: device.clone(),
            inode: meta.ino(),
        })
    });
    Some(segments.collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// memprof's own mappings, rebuilt from its executable's load bias, match `/proc/self/maps`.
    #[test]
    fn the_loaded_objects_give_the_mappings_proc_shows() {
        let maps = crate::process::procfs::file_mappings(std::process::id()).expect("own maps");
        let exe = std::fs::read_link("/proc/self/exe").expect("own exe").display().to_string();
        let text = maps.iter().find(|m| m.executable && m.path == exe).expect("own text mapping");
        let data = fs::read(&exe).expect("own exe");
        let file = object::File::parse(&*data).expect("ELF");
        let segment = file
            .segments()
            .find(|s| matches!(s.flags(), object::SegmentFlags::Elf { p_flags } if p_flags & 1 != 0))
            .expect("a text segment");
        let base = text.start - (segment.address() & !4095);
        let rebuilt = mappings(&[(base, String::new())], Some(&exe));
        let found = rebuilt.iter().find(|m| m.executable).expect("rebuilt text");
        assert_eq!((found.start, found.offset, found.inode), (text.start, text.offset, text.inode));
        assert_eq!(found.device, text.device);
    }

    /// The executable keeps the name memprof knows it by, a link's when it was started by one
    /// (Debian's redis-server is a link to redis-check-rdb); a library is named by its own path.
    #[test]
    fn the_executable_keeps_its_name_and_a_library_is_named_by_its_own_path() {
        let exe = std::fs::read_link("/proc/self/exe").expect("own exe").display().to_string();
        let dir = std::env::temp_dir().join(format!("memprof-link-map-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let link = dir.join("started-as").display().to_string();
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&exe, &link).unwrap();
        let as_exe = mappings(&[(0, String::new())], Some(&link));
        let as_library = mappings(&[(0, link.clone())], None);
        let _ = fs::remove_dir_all(&dir);
        assert!(!as_exe.is_empty() && as_exe.iter().all(|m| m.path == link), "{as_exe:?}");
        assert!(!as_library.is_empty() && as_library.iter().all(|m| m.path == exe), "{as_library:?}");
    }

    /// A static program linked at fixed addresses gives its mappings alone; one with a dynamic
    /// linker does not, fixed or position-independent.
    #[test]
    fn only_a_static_executable_gives_its_mappings_alone() {
        let program = "int main(void) { return 0; }\n";
        let fixed = crate::compiled::compile("link-map-static", program, &["-static", "-no-pie"]);
        let mappings = fixed_executable(fixed.path.to_str().unwrap()).expect("a static executable's mappings");
        assert!(mappings.iter().any(|m| m.executable), "{mappings:?}");
        for (test, flags) in [("link-map-dynamic", &["-no-pie"][..]), ("link-map-pie", &["-pie", "-fPIE"][..])] {
            let dynamic = crate::compiled::compile(test, program, flags);
            assert!(fixed_executable(dynamic.path.to_str().unwrap()).is_none(), "{flags:?}");
        }
    }
}
