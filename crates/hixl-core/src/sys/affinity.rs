//! CPU affinity of the calling thread (sched_getaffinity(2) / sched_setaffinity(2)).

use std::io;

use super::cvt;

/// The CPUs the calling thread may run on, ascending.
pub(crate) fn current() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most `size_of::<cpu_set_t>()` bytes into the live `set`.
    cvt(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) })?;
    // SAFETY: CPU_ISSET reads bit `c` of `set`, and every `c` is below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// Lets the calling thread run only on `cpus` (each below `CPU_SETSIZE`, which the caller
/// checked); EINVAL when none of them is usable.
pub(crate) fn set_current(cpus: &[usize]) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: `c` is below CPU_SETSIZE, so the bit lies inside `set`.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: the kernel reads `size_of::<cpu_set_t>()` bytes from the live `set`.
    cvt(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) }).map(|_| ())
}
