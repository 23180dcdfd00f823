//! A tiny Chrome DevTools Protocol client over `--remote-debugging-pipe`: headless Chromium reads
//! commands on fd 3 and writes answers and events on fd 4, each a JSON object ending in a NUL.

use std::{
    fs::File,
    io::{BufRead, BufReader, Write},
    os::{
        fd::{FromRawFd, OwnedFd},
        unix::process::CommandExt,
    },
    process::{Child, Stdio},
};

use memprof_tests::{chromium, Scratch};

use serde_json::{json, Value};

/// One page open in headless Chromium; the browser ends when this is dropped.
pub struct Page {
    child: Child,
    commands: File,
    answers: BufReader<File>,
    next_id: u64,
    session: String,
    /// Events read while waiting for an answer, oldest first.
    events: Vec<Value>,
    /// Removed as a field, after `drop` has ended the browser.
    _profile: Scratch,
}

/// A pipe (read end, write end) whose descriptors are at least 10, so that moving them to 3 and 4
/// in the child cannot overwrite one with the other, and closed on exec in every other child.
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe2(2) writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "{}", std::io::Error::last_os_error());
    let high = fds.map(|fd| {
        // SAFETY: fd is open; the copy is new and closed on exec; the original is closed once.
        unsafe {
            let copy = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
            assert!(copy >= 10, "{}", std::io::Error::last_os_error());
            libc::close(fd);
            OwnedFd::from_raw_fd(copy)
        }
    });
    let [read, write] = high;
    (read, write)
}

impl Page {
    /// Starts Chromium with `flags` and the profile directory `profile`, opens `url` and waits
    /// until it has loaded.
    pub fn open(flags: &[&str], profile: Scratch, url: &str) -> Self {
        let (browser_reads, commands) = pipe();
        let (answers, browser_writes) = pipe();
        let (read_fd, write_fd) =
            (std::os::fd::AsRawFd::as_raw_fd(&browser_reads), std::os::fd::AsRawFd::as_raw_fd(&browser_writes));
        let mut command = chromium::command(&profile);
        command
            .args(flags)
            .arg("--remote-debugging-pipe")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls between fork and exec: dup2 puts the pipe ends
        // where Chromium expects them (dup2 clears close-on-exec on the copies).
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(read_fd, 3) < 0 || libc::dup2(write_fd, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("starting chromium (installed by `cargo xtask setup`)");
        drop((browser_reads, browser_writes));
        let mut page = Self {
            child,
            commands: File::from(commands),
            answers: BufReader::new(File::from(answers)),
            next_id: 0,
            session: String::new(),
            events: Vec::new(),
            _profile: profile,
        };
        let target = page.call("Target.createTarget", json!({ "url": "about:blank" }));
        let attached = page.call("Target.attachToTarget", json!({ "targetId": target["targetId"], "flatten": true }));
        page.session = attached["sessionId"].as_str().expect("a session id").to_string();
        page.call("Page.enable", json!({}));
        page.call("Page.navigate", json!({ "url": url }));
        page.wait_event("Page.loadEventFired");
        page
    }

    /// The next message from Chromium.
    fn read(&mut self) -> Value {
        let mut bytes = Vec::new();
        let read = self.answers.read_until(0, &mut bytes).expect("reading chromium's answers");
        assert!(read > 0 && bytes.pop() == Some(0), "chromium closed its pipe");
        serde_json::from_slice(&bytes).expect("chromium answers JSON")
    }

    /// Waits for the event `method`.
    fn wait_event(&mut self, method: &str) {
        if let Some(seen) = self.events.iter().position(|e| e["method"] == method) {
            self.events.drain(..=seen);
            return;
        }
        while self.read()["method"] != method {}
        self.events.clear();
    }

    /// Sends `method` (to the page once attached) and returns its result; events are kept.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let mut message = json!({ "id": self.next_id, "method": method, "params": params });
        if !self.session.is_empty() {
            message["sessionId"] = json!(self.session);
        }
        self.commands.write_all(message.to_string().as_bytes()).unwrap();
        self.commands.write_all(b"\0").unwrap();
        loop {
            let answer = self.read();
            if answer["id"] == self.next_id {
                assert!(answer.get("error").is_none(), "{method} failed: {answer}");
                return answer["result"].clone();
            }
            if answer.get("method").is_some() {
                self.events.push(answer);
            }
        }
    }

    /// The value of a JavaScript expression in the page (awaited if it is a promise).
    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call("Runtime.evaluate", json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }));
        assert!(result.get("exceptionDetails").is_none(), "{expression} threw: {result}");
        result["result"]["value"].clone()
    }

    /// Types `text` into the focused element, as a keyboard would.
    pub fn type_text(&mut self, text: &str) {
        self.call("Input.insertText", json!({ "text": text }));
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
