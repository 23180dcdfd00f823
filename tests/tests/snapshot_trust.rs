//! What `memprof snapshot` and `memprof diff` read, from whoever wrote it: a report from a
//! listener that is not root's (a port, or a socket where others may write) is refused, and no answer or file is read past 256 MiB, a gzip
//! bomb's decompressed bytes included. Each refusal is one line and a non-zero exit.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
};

use memprof_tests::{free_port, memprof, Outcome};

/// A private directory for one test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memprof-trust-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn assert_fails(outcome: &Outcome, says: &str) {
    assert!(!outcome.status.success(), "{outcome:?}");
    assert_eq!(outcome.stderr.lines().count(), 1, "one line: {}", outcome.stderr);
    assert!(outcome.stderr.starts_with("memprof: error: ") && outcome.stderr.contains(says), "{}", outcome.stderr);
}

/// `server`, a Python listener answering a forged report, run as nobody; started once it says
/// it is ready.
fn forger(server: &str) -> Child {
    let mut forger = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", server])
        .stdout(Stdio::piped())
        .spawn()
        .expect("setpriv and python3");
    let mut ready = String::new();
    BufReader::new(forger.stdout.as_mut().unwrap()).read_line(&mut ready).unwrap();
    assert_eq!(ready, "ready\n");
    forger
}

#[test]
fn snapshot_refuses_the_answer_of_a_listener_that_is_not_roots() {
    let dir = scratch("forged");
    let port = free_port();
    // A listener started by nobody on the port, answering a forged report to anyone.
    let server = format!(
        "import socket\n\
         s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('127.0.0.1', {port})); s.listen(16); print('ready', flush=True)\n\
         while True:\n    c, _ = s.accept(); c.recv(4096)\n    \
         c.sendall(b'HTTP/1.0 200 OK\\r\\nContent-Length: 16\\r\\n\\r\\n{{\"forged\": true}}'); c.close()\n"
    );
    let mut forger = forger(&server);
    let output = dir.join("heap.json");
    let pid = std::process::id().to_string();
    let url = format!("http://127.0.0.1:{port}");
    let outcome = memprof(&["snapshot", "--pid", &pid, "-o", output.to_str().unwrap(), "--daemon", &url]);
    let _ = forger.kill();
    let _ = forger.wait();
    assert_fails(&outcome, "belongs to uid 65534, not root or you: refusing its answer");
    assert!(!output.exists(), "the forged report was written");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Root's directory, but anyone may write in it: anyone's socket may be there, under a name not
/// taken yet, whether the directory is sticky (as /tmp) or not. The answer is refused, and no
/// password is sent.
#[test]
fn snapshot_refuses_a_socket_that_another_user_put_where_others_may_write() {
    for mode in [0o777, 0o1777] {
        let dir = scratch(&format!("socket-{mode:o}"));
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
        let socket = dir.join("api.sock");
        let server = format!(
            "import socket\n\
             s = socket.socket(socket.AF_UNIX); s.bind('{}'); s.listen(16); print('ready', flush=True)\n\
             while True:\n    c, _ = s.accept(); c.recv(4096)\n    \
             c.sendall(b'HTTP/1.0 200 OK\\r\\nContent-Length: 16\\r\\n\\r\\n{{\"forged\": true}}'); c.close()\n",
            socket.display()
        );
        let mut forger = forger(&server);
        let output = dir.join("heap.json");
        let pid = std::process::id().to_string();
        let outcome =
            memprof(&["snapshot", "--pid", &pid, "-o", output.to_str().unwrap(), "--daemon", socket.to_str().unwrap()]);
        let _ = forger.kill();
        let _ = forger.wait();
        assert_fails(&outcome, "belongs to uid 65534, not root or you, in a directory others may write to");
        assert!(!output.exists(), "the forged report was written ({mode:o})");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn snapshot_stops_reading_an_answer_at_256_mib() {
    let dir = scratch("huge");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Root's listener (ours), answering 400 MB.
    let server = std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut request = [0; 4096];
        let _ = client.read(&mut request);
        let _ = client.write_all(b"HTTP/1.0 200 OK\r\n\r\n");
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..400 {
            if client.write_all(&chunk).is_err() {
                break;
            }
        }
    });
    let output = dir.join("heap.pb.gz");
    let pid = std::process::id().to_string();
    let url = format!("http://127.0.0.1:{port}");
    let outcome = memprof(&["snapshot", "--pid", &pid, "-o", output.to_str().unwrap(), "--daemon", &url]);
    server.join().unwrap();
    assert_fails(&outcome, "its answer is larger than 256 MiB");
    assert!(!output.exists(), "a partial answer was written");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn diff_refuses_a_gzip_bomb_at_256_mib() {
    let dir = scratch("bomb");
    let bomb = dir.join("bomb.pb.gz");
    // 300 MiB of zeros in about 300 KB.
    let made = Command::new("sh")
        .arg("-c")
        .arg(format!("head -c 300M /dev/zero | gzip -1 > {}", bomb.display()))
        .status()
        .unwrap();
    assert!(made.success());
    let bomb = bomb.to_str().unwrap();
    assert_fails(
        &memprof(&["diff", bomb, bomb]),
        "decompresses to more than 256 MiB, more than any profile memprof reads",
    );
    // A cut one is damaged, whatever its last four bytes (here those of a bomb) say.
    let bytes = std::fs::read(bomb).unwrap();
    let cut = dir.join("cut.pb.gz");
    std::fs::write(&cut, [&bytes[..bytes.len() / 2], &bytes[bytes.len() - 4..]].concat()).unwrap();
    let cut = cut.to_str().unwrap();
    assert_fails(&memprof(&["diff", cut, cut]), "is damaged: cannot decompress it");
    let _ = std::fs::remove_dir_all(&dir);
}
