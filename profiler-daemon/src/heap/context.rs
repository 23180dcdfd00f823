//! Where and when a report was made: what a report read days later, on another machine, needs to
//! say which run it describes.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunContext {
    /// When tracing began, UTC (RFC 3339).
    pub started: String,
    /// The same moment in nanoseconds since the Unix epoch, for programs (pprof's `time_nanos`).
    pub started_unix_ns: u64,
    pub host: String,
    pub memprof_version: String,
    /// memprof's own command line.
    pub command_line: Vec<String>,
}

impl RunContext {
    /// This run's: now, this host, this binary, its arguments.
    pub fn now() -> Self {
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Self {
            started: rfc3339(since_epoch.as_millis() as u64),
            started_unix_ns: since_epoch.as_nanos() as u64,
            host: host_name(),
            memprof_version: env!("CARGO_PKG_VERSION").to_string(),
            command_line: std::env::args_os().map(|arg| arg.to_string_lossy().into_owned()).collect(),
        }
    }
}

fn host_name() -> String {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is as long as the length passed; the kernel writes at most that much.
    let done = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    if done != 0 {
        return String::new();
    }
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    String::from_utf8_lossy(&name[..end]).into_owned()
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for milliseconds since the Unix epoch (days to dates as in Howard
/// Hinnant's `civil_from_days`).
fn rfc3339(unix_ms: u64) -> String {
    let (days, ms_of_day) = ((unix_ms / 86_400_000) as i64, unix_ms % 86_400_000);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let (h, m, s, ms) = (ms_of_day / 3_600_000, ms_of_day / 60_000 % 60, ms_of_day / 1000 % 60, ms_of_day % 1000);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{ms:03}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        // `date -u -d @1795941427.5 +%FT%T.%3NZ`
        assert_eq!(rfc3339(1_795_941_427_500), "2026-11-29T08:37:07.500Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
