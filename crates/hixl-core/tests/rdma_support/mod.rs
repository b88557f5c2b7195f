//! Shared by the rdma test binaries: the child process they start (this same binary again),
//! spoken to by lines, and small helpers.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// The wait of every step.
pub const T: Duration = Duration::from_secs(10);
/// Set in a child process to its role.
pub const CHILD: &str = "HIXL_RDMA_CHILD";

/// Whether the tests run on a real device (scripts/rdma_check.sh) rather than the soft provider.
pub fn on_hardware() -> bool {
    std::env::var("HIXL_RDMA_DEVICE").is_ok_and(|d| !d.is_empty())
}

pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

pub fn hash(b: &[u8]) -> String {
    blake3::hash(b).to_hex().to_string()
}

/// A child process of this test binary, spoken to by lines.
pub struct Peer {
    pub child: Child,
    pub stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Peer {
    pub fn start(role: &str, env: &[(&str, &str)]) -> Peer {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args([&format!("child_{role}"), "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(|l| l.ok()) {
                // The harness may have started the line ("test child_x ... ").
                if let Some(at) = l.find("@@ ") {
                    if tx.send(l[at + 3..].to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        Peer { child, stdin, lines }
    }

    pub fn line(&self) -> String {
        match self.lines.recv_timeout(T) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => panic!("the peer said nothing for {T:?}"),
            Err(RecvTimeoutError::Disconnected) => panic!("the peer exited"),
        }
    }

    pub fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }

    pub fn kill(&mut self) {
        // SIGKILL: no cleanup of any kind in the peer.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Prints a line for the parent (prefixed: the test harness prints its own lines too).
pub fn say(s: &str) {
    println!("@@ {s}");
    std::io::stdout().flush().unwrap();
}

pub fn commands() -> impl Iterator<Item = String> {
    std::io::stdin().lines().map_while(|l| l.ok())
}
