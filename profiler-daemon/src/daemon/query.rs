//! The query strings of the per-process endpoints (`/api/v1/leaks`, `/debug/pprof/*`,
//! `/api/v1/flamegraph`, `/report`, `/api/v1/inspect`), parsed by hand so that any malformed query gets a 400 with
//! the JSON error body and a message that says what to send.

use percent_encoding::percent_decode_str;

use crate::heap::heuristics::Heuristics;

/// Longest part of a bad value quoted back in an error.
const QUOTED: usize = 40;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("the pid parameter is missing: {0}?pid=N")]
    MissingPid(String),
    #[error("pid `{0}` is not a process id: give a number from 1 to 4294967295")]
    BadPid(String),
    #[error("heuristics `{0}`: {1}")]
    BadHeuristics(String, String),
}

/// The `pid=N` of `query` (the first one, as Go's servers read repeated parameters).
pub fn pid(query: Option<&str>, path: &str) -> Result<u32, QueryError> {
    let value = param(query, "pid").ok_or_else(|| QueryError::MissingPid(path.to_string()))?;
    // Digits only: `u32::from_str` would also take `+5`.
    match value.parse::<u32>() {
        Ok(pid) if pid > 0 && value.bytes().all(|b| b.is_ascii_digit()) => Ok(pid),
        _ => Err(QueryError::BadPid(value.chars().take(QUOTED).collect())),
    }
}

/// The `heuristics=SET` of `query` (memcheck's leak-check heuristics, `all` when absent).
pub fn heuristics(query: Option<&str>) -> Result<Heuristics, QueryError> {
    let Some(value) = param(query, "heuristics") else {
        return Ok(Heuristics::ALL);
    };
    value.parse().map_err(|why| QueryError::BadHeuristics(value.chars().take(QUOTED).collect(), why))
}

/// The value of the first parameter called `name`, both percent-decoded as a client encodes
/// them; empty for a parameter given without `=`, so that `?pid` is refused as `?pid=` is.
fn param(query: Option<&str>, name: &str) -> Option<String> {
    let decode = |text: &str| percent_decode_str(text).decode_utf8_lossy().into_owned();
    query.unwrap_or_default().split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(key) == name).then(|| decode(value))
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn pids_and_their_errors() {
        assert_eq!(pid(Some("pid=42"), "/p"), Ok(42));
        assert_eq!(pid(Some("debug=1&pid=7&pid=8"), "/p"), Ok(7));
        assert_eq!(
            pid(None, "/api/v1/leaks").unwrap_err().to_string(),
            "the pid parameter is missing: /api/v1/leaks?pid=N"
        );
        assert_eq!(pid(Some("pid=%zz&&"), "/p"), Err(QueryError::BadPid("%zz".into())));
        assert_eq!(pid(Some("pid=%34%32"), "/p"), Ok(42));
        assert_eq!(pid(Some("p%69d=9&pid=8"), "/p"), Ok(9));
        assert_eq!(pid(Some("pid&pid=8"), "/p"), Err(QueryError::BadPid(String::new())));
        for bad in ["pid", "pid=", "pid=0", "pid=+5", "pid=-1", "pid=4294967296", "pid=1 ", "pid=١"] {
            assert!(matches!(pid(Some(bad), "/p"), Err(QueryError::BadPid(_))), "{bad}");
        }
        let long = format!("pid={}", "9".repeat(1000));
        assert_eq!(pid(Some(&long), "/p"), Err(QueryError::BadPid("9".repeat(QUOTED))));
    }

    #[test]
    fn heuristics_and_their_errors() {
        assert_eq!(heuristics(Some("pid=1")), Ok(Heuristics::ALL));
        assert_eq!(heuristics(Some("pid=1&heuristics=none")), Ok(Heuristics::NONE));
        assert_eq!(heuristics(Some("heuristics=newarray%2Cstdstring")).unwrap().to_string(), "stdstring,newarray");
        let err = heuristics(Some("heuristics=cow")).unwrap_err().to_string();
        assert!(err.starts_with("heuristics `cow`: no heuristic is called 'cow'"), "{err}");
    }

    /// What `pid` must answer, written the other way: the first `pid` value, if all digits.
    fn expected(query: &str) -> Option<u32> {
        let first = query.split('&').find(|pair| decoded(pair.split('=').next().unwrap_or_default()) == "pid")?;
        let digits = decoded(first.split_once('=').map_or("", |(_, value)| value));
        let valid = !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit());
        valid.then(|| digits.parse().ok()).flatten().filter(|&n| n > 0)
    }

    /// `text` with each `%` and two hex digits replaced by the byte they name.
    fn decoded(text: &str) -> String {
        let mut bytes = Vec::new();
        let mut rest = text.as_bytes();
        while let Some(&first) = rest.first() {
            let hex = rest.get(1..3).and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
            match (first, hex) {
                (b'%', Some(byte)) if rest[1].is_ascii_hexdigit() => {
                    bytes.push(byte);
                    rest = &rest[3..];
                }
                _ => {
                    bytes.push(first);
                    rest = &rest[1..];
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    proptest! {
        /// Any query: the pid when the first `pid=` holds only its digits, else an error that
        /// names the parameter, fits on one line and quotes at most `QUOTED` characters.
        #[test]
        fn any_query_gets_a_pid_or_a_clear_error(query in any::<String>()) {
            let result = pid(Some(&query), "/api/v1/leaks");
            prop_assert_eq!(result.as_ref().ok().copied(), expected(&query), "{:?}", query);
            if let Err(err) = result {
                let message = err.to_string();
                prop_assert!(message.contains("pid"));
                if let QueryError::BadPid(quoted) = &err {
                    prop_assert!(quoted.chars().count() <= QUOTED);
                }
            }
        }

        /// Queries shaped like real ones, with junk in the value and around the pair.
        #[test]
        fn pid_values_of_any_shape(before in "[a-z0-9=&%]{0,12}", value in ".{0,24}", after in "(&[a-z]{1,5}=.{0,8}){0,3}") {
            let query = format!("{before}&pid={value}{after}");
            prop_assert_eq!(pid(Some(&query), "/debug/pprof/heap").ok(), expected(&query), "{:?}", query);
        }
    }
}
