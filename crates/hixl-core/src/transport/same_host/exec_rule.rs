//! Exec after the proof: when a proven same-host peer may be copied to directly.
//!
//! The direct path (cross-memory attach by pid, memfds taken by pidfd) goes to whatever image
//! the proven process runs, and a process keeps its pid and pidfd across `execve`. A peer that
//! proved itself and then execs a setuid program (while a forked child keeps the streams and
//! announces a region inside that program) would have our copies land in the new image.
//!
//! - **This process may not override ptrace checks** (no `CAP_SYS_PTRACE` in its effective
//!   set, root or not): the kernel checks every `process_vm_readv`/`process_vm_writev` and
//!   `pidfd_getfd` against the image the pid runs at that moment, under the lock that `execve`
//!   takes to change credentials. An image that an exec made more privileged (another uid or
//!   gid, file capabilities, or non-dumpable) fails that check (EPERM), so the direct path is
//!   taken as before.
//! - **This process may** (root, as a rule): the kernel's check always passes, so we take the
//!   direct path only with a peer that could itself reach any image it might exec, i.e. root:
//!   the kernel recorded uid 0 as the creator of its same-host socket (`SO_PEERCRED`, at
//!   `listen`), and its real, effective, saved and file-system uids are 0 at the proof. Any
//!   other peer gets another backend (`tcp`), and the reason says so.
//!
//! A check per copy could not replace this: copies go by pid, so an exec between the check and
//! the system call would still be copied into; the rule instead leaves nothing to re-check (a
//! root peer gains nothing by an exec), and costs one read of `/proc/self/status` and one of
//! `/proc/PID/status` per proof, nothing per copy.

/// `CAP_SYS_PTRACE`'s bit in the capability sets of `/proc/PID/status`.
const CAP_SYS_PTRACE: u32 = 19;

/// Whether this process may override the kernel's ptrace access checks (`CAP_SYS_PTRACE` in
/// its effective set). Unreadable status counts as yes: the stricter rule then applies.
pub fn ptrace_override() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return true };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_none_or(|caps| caps & (1 << CAP_SYS_PTRACE) != 0)
}

/// The real, effective, saved and file-system uids of process `pid`.
pub fn uids_of(pid: i32) -> std::result::Result<[u32; 4], String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("pid {pid}: {e}"))?;
    let line =
        status.lines().find_map(|l| l.strip_prefix("Uid:")).ok_or(format!("pid {pid}: no Uid line"))?;
    let ids: Vec<u32> = line.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    <[u32; 4]>::try_from(ids).map_err(|_| format!("pid {pid}: malformed Uid line {line:?}"))
}

/// Why the direct path must not be used with the proven process `pid` (None: it may be), for
/// a process that may (`privileged`) or may not override ptrace checks; `socket_uid` is the
/// uid the kernel recorded for the peer's same-host socket, `uids` the process's uids now.
pub fn refusal(privileged: bool, pid: i32, socket_uid: u32, uids: [u32; 4]) -> Option<String> {
    if !privileged || (socket_uid == 0 && uids == [0; 4]) {
        return None;
    }
    Some(format!(
        "this process may access any process's memory (CAP_SYS_PTRACE) and pid {pid} is not root \
         (its socket was made by uid {socket_uid}; real, effective, saved, fs uids now {uids:?}): \
         after an exec of a setuid program it would keep its pid, and direct copies would reach \
         that program (exec after proof, docs/RELIABILITY.md)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_privileged_process_refuses_and_only_non_root_peers() {
        assert_eq!(refusal(false, 7, 1000, [1000; 4]), None, "the kernel checks every copy");
        assert_eq!(refusal(false, 7, 1000, [1000, 0, 0, 0]), None);
        assert_eq!(refusal(true, 7, 0, [0; 4]), None, "root to root stays direct");
        let why = refusal(true, 7, 65534, [65534; 4]).unwrap();
        assert!(why.contains("pid 7") && why.contains("65534") && why.contains("root"), "{why}");
        // A setuid-root image seen at the proof (a race with the peer's exec): real uid not 0.
        assert!(refusal(true, 7, 65534, [65534, 0, 0, 0]).is_some());
        // A socket made before a drop to root's uids is not enough, nor root's socket alone.
        assert!(refusal(true, 7, 1000, [0; 4]).is_some());
        assert!(refusal(true, 7, 0, [1000, 1000, 0, 1000]).is_some());
    }

    #[test]
    fn this_process_reads_its_own_credentials() {
        let me = std::process::id() as i32;
        let (uid, euid) = crate::sys::uids();
        let ids = uids_of(me).unwrap();
        assert_eq!((ids[0], ids[1]), (uid, euid));
        assert!(uids_of(-1).is_err());
    }
}
