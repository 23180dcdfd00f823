//! Debian's nginx, a real server whose workers exist before memprof: `attach --follow-forks` on
//! its master traces the running workers (`forks.at_attach`), each named, with the requests they
//! serve after the attach, and their allocation wrappers (`ngx_alloc`, `ngx_memalign`) folded so
//! that each site is the caller.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
};

use memprof_tests::{free_port, memprof_bin, released, wait_for};

const WORKERS: u64 = 2;
const REQUESTS: u64 = 40;

/// nginx with a configuration of its own in a directory of its own, in the foreground; killed and
/// removed when dropped.
struct Nginx {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Nginx {
    fn start() -> Self {
        assert!(std::path::Path::new("/usr/sbin/nginx").exists(), "nginx is missing: run `cargo xtask setup`");
        let dir = std::env::temp_dir().join(format!("memprof-nginx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let d = dir.display();
        let config = format!(
            "daemon off; master_process on; worker_processes {WORKERS}; pid {d}/nginx.pid; error_log {d}/error.log;\n\
             events {{ worker_connections 64; }}\n\
             http {{ access_log off; client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
               fastcgi_temp_path {d}/fastcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
               server {{ listen 127.0.0.1:{port}; location / {{ return 200 \"hello\\n\"; }} }} }}\n"
        );
        std::fs::write(dir.join("nginx.conf"), config).unwrap();
        let child = Command::new("/usr/sbin/nginx")
            .args(["-p", &dir.display().to_string(), "-c", &dir.join("nginx.conf").display().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nginx");
        let nginx = Self { child, dir, port };
        wait_for(20, "nginx to serve", || nginx.get().then_some(()));
        wait_for(20, "nginx's workers to start", || (nginx.workers().len() as u64 == WORKERS).then_some(()));
        nginx
    }

    /// One request on a connection of its own; whether it was answered.
    fn get(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        if stream.write_all(b"GET / HTTP/1.0\r\n\r\n").is_err() {
            return false;
        }
        let mut answer = String::new();
        stream.read_to_string(&mut answer).is_ok() && answer.ends_with("hello\n")
    }

    /// The master's children, its workers.
    fn workers(&self) -> Vec<u32> {
        let children = format!("/proc/{0}/task/{0}/children", self.child.id());
        let text = std::fs::read_to_string(children).unwrap_or_default();
        text.split_whitespace().filter_map(|pid| pid.parse().ok()).collect()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // Listed while the master lives: its workers outlive it (they were left running).
        let workers = self.workers();
        let _ = self.child.kill();
        let _ = self.child.wait();
        for worker in workers {
            // SAFETY: signalling a process this test started, through its master.
            unsafe { libc::kill(worker as i32, libc::SIGKILL) };
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn attach_follows_nginxs_running_workers_and_names_the_callers_of_its_wrappers() {
    let nginx = Nginx::start();
    let master = nginx.child.id();
    let workers = nginx.workers();
    let pid = master.to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof
        .args(["attach", "--pid", &pid, "--max-rate", "off", "--follow-forks", "--json", "--interval", "1"])
        .stdin(Stdio::null());
    // Requests once both workers are traced: memprof says so of each, as a child of the master.
    let traced_worker = format!(", child of pid {pid}, with ");
    let mut workers_traced = 0;
    let outcome = released(memprof, &[traced_worker.clone(), traced_worker], |memprof| {
        workers_traced += 1;
        if workers_traced < WORKERS {
            return;
        }
        for _ in 0..REQUESTS {
            assert!(nginx.get(), "nginx answers under memprof");
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(memprof.id() as i32, libc::SIGINT) };
    });
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    let forks = &report["forks"];
    assert_eq!(forks["at_attach"], WORKERS, "the workers that were running are followed: {forks}");
    let children = report["children"].as_array().expect("children");
    let mut traced: Vec<u32> = children.iter().map(|c| c["pid"].as_u64().unwrap() as u32).collect();
    traced.sort();
    let mut expected = workers.clone();
    expected.sort();
    assert_eq!(traced, expected, "{forks}");
    let mut allocations = 0;
    for child in children {
        assert_eq!(child["comm"], "nginx", "{child}");
        assert_eq!(child["parent"], master, "{child}");
        allocations += child["totals"]["allocations"].as_u64().unwrap();
        for stack in child["stacks"].as_array().unwrap() {
            let site = stack["frames"][0]["function"].as_str().unwrap_or("");
            assert!(!["ngx_alloc", "ngx_memalign", "ngx_calloc"].contains(&site), "a wrapper is no site: {stack}");
        }
    }
    // Each request's connection gets a pool of its own from the worker that accepts it.
    assert!(allocations >= REQUESTS, "{allocations} allocations for {REQUESTS} requests");
}
