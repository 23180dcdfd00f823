//! A Prometheus server (Debian's package) scraping a memprof daemon every second.

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
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: memprof\n{job}    static_configs:\n      - targets: ['127.0.0.1:{scrape_port}']\n"
            ),
        )
        .unwrap();
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

    /// The value of an instant query that returns one series.
    pub fn query(&self, query: &str) -> Option<f64> {
        let (_, body) = http_get(self.port, &format!("/api/v1/query?query={}", encode(query)))?;
        let json: Value = serde_json::from_str(&body).ok()?;
        json["data"]["result"].as_array()?.first()?["value"][1].as_str()?.parse().ok()
    }
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
