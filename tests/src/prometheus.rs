//! A Prometheus server (Debian's package) scraping a memprof daemon every second, in two jobs:
//! every series comes twice, apart from `job`, as from the daemons of two servers, so queries
//! that join series must say how to keep the targets apart.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
};

use serde_json::Value;

use crate::{free_port, http_get};

pub struct Prometheus {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Prometheus {
    /// Scrapes `127.0.0.1:scrape_port` over plain HTTP.
    pub fn start(scrape_port: u16) -> Self {
        Self::start_with(scrape_port, "")
    }

    /// `job` is added to the scrape job's YAML, each line indented by four spaces (such as
    /// `    scheme: https\n`).
    pub fn start_with(scrape_port: u16, job: &str) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("memprof-prometheus-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        let jobs: String = ["memprof", "memprof-again"]
            .iter()
            .map(|name| {
                format!(
                    "  - job_name: {name}\n{job}    static_configs:\n      - targets: ['127.0.0.1:{scrape_port}']\n"
                )
            })
            .collect();
        std::fs::write(&config, format!("global:\n  scrape_interval: 1s\nscrape_configs:\n{jobs}")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting prometheus (installed by xtask setup)");
        Self { child, port, dir }
    }

    /// The value of the first series an instant query returns.
    pub fn query(&self, query: &str) -> Option<f64> {
        self.series(query).ok()?.first()?["value"][1].as_str()?.parse().ok()
    }

    /// The series an instant query returns (`metric` and `value` each), or Prometheus's error.
    pub fn series(&self, query: &str) -> Result<Vec<Value>, String> {
        let (_, body) = http_get(self.port, &format!("/api/v1/query?query={}", encode(query)))
            .ok_or_else(|| "Prometheus did not answer".to_string())?;
        let json: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        match json["data"]["result"].as_array() {
            Some(result) if json["status"] == "success" => Ok(result.clone()),
            _ => Err(json["error"].as_str().unwrap_or(&body).to_string()),
        }
    }
}

/// The PromQL query of the series `selector` of process `pid`: series carry its comm and slot,
/// and `memprof_target_attached` says which pid they stand for.
pub fn of_pid(selector: &str, pid: u32) -> String {
    format!("{selector} * on(instance, job, comm, slot) group_left memprof_target_attached{{pid=\"{pid}\"}}")
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn encode(query: &str) -> String {
    query
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b == b'_' { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}
