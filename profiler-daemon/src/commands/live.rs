//! `attach --live` and `run --live`: each interval's report drawn in place on the terminal, on
//! its alternate screen (`format::screen`), left when the session ends so that the final report
//! is printed below what was there before, as without `--live`.

use std::io::{self, IsTerminal as _, Write as _};

use crate::{
    error::UserError,
    format::screen::{self, Rates},
    heap::report::Report,
};

/// The terminal's size when it does not say.
const DEFAULT_SIZE: (usize, usize) = (24, 80);

pub struct LiveView {
    /// The alternate screen is in use.
    entered: bool,
    /// Seconds, allocations and bytes allocated of the last report drawn, for the rates: the
    /// first frame's are since tracing began.
    last: (f64, u64, u64),
}

impl LiveView {
    /// The view, when standard output is a terminal.
    pub fn open() -> anyhow::Result<Self> {
        if !io::stdout().is_terminal() {
            return Err(UserError::LiveNeedsTerminal.into());
        }
        Ok(Self { entered: false, last: (0.0, 0, 0) })
    }

    /// Draws `report` over the last screen.
    pub fn draw(&mut self, report: &Report) -> io::Result<()> {
        let t = &report.totals;
        let (at, allocations, bytes) = self.last;
        let rates = if report.duration_s > at {
            let seconds = report.duration_s - at;
            Rates {
                allocations_per_s: t.allocations.saturating_sub(allocations) as f64 / seconds,
                bytes_per_s: t.allocated_bytes.saturating_sub(bytes) as f64 / seconds,
            }
        } else {
            Rates::default()
        };
        self.last = (report.duration_s, t.allocations, t.allocated_bytes);
        let (rows, columns) = size();
        let mut out = io::stdout().lock();
        if !self.entered {
            // The alternate screen, the cursor hidden.
            out.write_all(b"\x1b[?1049h\x1b[?25l")?;
            self.entered = true;
        }
        // Home, the screen, then clear what is below it.
        out.write_all(b"\x1b[H")?;
        out.write_all(screen::render(report, rates, rows, columns).as_bytes())?;
        out.write_all(b"\x1b[J")?;
        out.flush()
    }
}

impl Drop for LiveView {
    /// Back to the main screen, the cursor shown: on every path, errors included.
    fn drop(&mut self) {
        if self.entered {
            let mut out = io::stdout().lock();
            let _ = out.write_all(b"\x1b[?25h\x1b[?1049l");
            let _ = out.flush();
        }
    }
}

/// The terminal's rows and columns.
fn size() -> (usize, usize) {
    let mut size = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the struct it is given, which lives here.
    let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) } == 0;
    if ok && size.ws_row > 0 && size.ws_col > 0 {
        (size.ws_row as usize, size.ws_col as usize)
    } else {
        DEFAULT_SIZE
    }
}
