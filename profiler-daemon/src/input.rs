//! Files memprof is given to read that are settings, rules or certificates: read with a bound,
//! as a path such as `/dev/zero` would take all the memory there is. A FIFO is read as `cat`
//! reads one: once its writer comes.

use std::{io, path::Path};

/// The bytes of the file at `path`, refused past `limit` bytes: a config file, a list of rules
/// or a certificate that large is none.
pub fn read_at_most(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    crate::format::read_at_most(std::fs::File::open(path)?, limit)?.ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, format!("larger than {} KiB: not such a file", limit >> 10))
    })
}

/// `read_at_most`, as UTF-8 text.
pub fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_at_most(path, limit)?).map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_past_the_limit_is_refused() {
        let err = read_text(Path::new("/dev/zero"), 4096).unwrap_err();
        assert!(err.to_string().contains("larger than 4 KiB"), "{err}");
    }
}
