//! The commands an engineer runs at a terminal: `attach` and `run` (a session, the process family it
//! follows and the target it starts or watches), `snapshot`, `inspect`, `diff`, and the completions
//! and man pages. The daemon is in `daemon`.

pub mod completions;
pub mod daemon_client;
pub mod diff;
pub mod family;
pub mod inspect;
pub mod live;
pub mod manual;
pub mod moment;
pub mod output;
pub mod recording;
pub mod report;
pub mod session;
pub mod snapshot;
pub mod suppress;
pub mod target;
