//! Copy workers shared by every same-host link of an engine (`hixl.shm.threads` of them): a
//! link with queued copies puts itself on the pool's run queue (once per queued part, so that
//! the shares of a split request run in parallel), and a worker copies one batch of it, then
//! puts it back at the end of the queue if more is left, so links take turns.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result};

/// How long an idle worker polls for the next task before it sleeps: back-to-back requests
/// then need no wake-up. One worker at a time polls; the others sleep at once, so that idle
/// workers never take the cores of the threads that submit (on a 2-core machine two pollers
/// more than doubled what a small asynchronous request cost its submitter).
const SPIN: Duration = Duration::from_micros(100);

/// Held while a worker copies a long batch (see [`CopyPool::long_batch`]).
pub(crate) struct LongBatch<'a>(&'a AtomicUsize);

impl Drop for LongBatch<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A link with copies to run.
pub(crate) trait Task: Send + Sync {
    /// Runs one batch; returns whether more is queued.
    fn run_batch(&self) -> bool;
}

/// The shared copy workers.
pub struct CopyPool {
    queue: SegQueue<Arc<dyn Task>>,
    sleepers: AtomicUsize,
    /// Whether a worker is polling the queue (at most one is).
    polling: AtomicBool,
    /// Workers copying a long batch (see [`CopyPool::long_batch`]).
    long: AtomicUsize,
    bell: (Mutex<()>, Condvar),
    stopping: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    workers: usize,
}

impl CopyPool {
    /// Starts `workers` copy threads (at least one), pinned to `cpus` (None: the inherited set).
    pub fn start(workers: usize, cpus: Option<crate::place::Cpus>) -> Result<Arc<CopyPool>> {
        let workers = workers.max(1);
        let pool = Arc::new(CopyPool {
            queue: SegQueue::new(),
            sleepers: AtomicUsize::new(0),
            polling: AtomicBool::new(false),
            long: AtomicUsize::new(0),
            bell: (Mutex::new(()), Condvar::new()),
            stopping: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            workers,
        });
        for i in 0..workers {
            let p = pool.clone();
            let name = format!("hixl-copy{i}");
            match crate::place::spawn_on(
                name.clone(),
                cpus.clone().or_else(crate::place::inherited),
                move || p.worker(),
            ) {
                Ok(h) => pool.threads.lock().unwrap().push(h),
                Err(e) => {
                    pool.stop();
                    return Err(Error::failed(format!("cannot start thread {name}: {e}")));
                }
            }
        }
        Ok(pool)
    }

    /// How many copy threads run.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Queues `task` to run `times` batches' worth (one per queued part). `small`: the parts
    /// are small copies, which a worker that is awake and not in a long batch (polling, or
    /// copying small parts and about to look again) takes soon enough: waking a second worker
    /// would cost the submitter more than the copy (and a thread that waits for the request
    /// helps, `ShmLink`'s `WaitHelp`).
    pub(crate) fn push(&self, task: &Arc<dyn Task>, times: usize, small: bool) {
        for _ in 0..times {
            self.queue.push(task.clone());
        }
        let sleepers = self.sleepers.load(Ordering::SeqCst);
        // A worker that is about to sleep counts as awake here; it looks at the queue again
        // after it counted itself a sleeper, so the task cannot be missed. A worker that starts
        // a long batch just after this look delays the task by that batch at most.
        let free = self.workers.saturating_sub(sleepers + self.long.load(Ordering::SeqCst));
        if sleepers == 0 || (small && times == 1 && free > 0) {
            return;
        }
        {
            let _g = self.bell.0.lock().unwrap();
            if times > 1 {
                self.bell.1.notify_all();
            } else {
                self.bell.1.notify_one();
            }
        }
    }

    /// Marks the calling worker as copying a long batch until the guard drops: small tasks
    /// pushed meanwhile wake another worker rather than wait for this one.
    pub(crate) fn long_batch(&self) -> LongBatch<'_> {
        self.long.fetch_add(1, Ordering::SeqCst);
        LongBatch(&self.long)
    }

    fn next(&self) -> Option<Arc<dyn Task>> {
        if let Some(t) = self.queue.pop() {
            return Some(t);
        }
        if self.polling.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            let until = Instant::now() + SPIN;
            let mut found = None;
            while Instant::now() < until && !self.stopping.load(Ordering::Acquire) {
                if let Some(t) = self.queue.pop() {
                    found = Some(t);
                    break;
                }
                std::hint::spin_loop();
                std::thread::yield_now();
            }
            self.polling.store(false, Ordering::SeqCst);
            if found.is_some() {
                return found;
            }
        }
        let mut g = self.bell.0.lock().unwrap();
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let t = loop {
            if let Some(t) = self.queue.pop() {
                break Some(t);
            }
            if self.stopping.load(Ordering::Acquire) {
                break None;
            }
            g = self.bell.1.wait(g).unwrap();
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        t
    }

    fn worker(&self) {
        while let Some(task) = self.next() {
            // A panic (a bug) loses that batch, not the worker: the others' counts stay true.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task.run_batch())) {
                Ok(true) => self.queue.push(task),
                Ok(false) => {}
                Err(_) => tracing::error!("a same-host copy batch panicked; its parts are lost"),
            }
        }
    }

    /// Stops the workers after the batches under way (queued tasks are dropped: their links
    /// fail what they queued when they close).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        {
            let _g = self.bell.0.lock().unwrap();
            self.bell.1.notify_all();
        }
        let me = std::thread::current().id();
        for h in std::mem::take(&mut *self.threads.lock().unwrap()) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        while self.queue.pop().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Countdown {
        left: Mutex<u32>,
        ran: AtomicUsize,
    }

    impl Task for Countdown {
        fn run_batch(&self) -> bool {
            let mut l = self.left.lock().unwrap();
            if *l == 0 {
                return false;
            }
            *l -= 1;
            self.ran.fetch_add(1, Ordering::SeqCst);
            *l > 0
        }
    }

    #[test]
    fn tasks_run_until_done_taking_turns() {
        let pool = CopyPool::start(2, None).unwrap();
        let tasks: Vec<Arc<Countdown>> =
            (0..8).map(|_| Arc::new(Countdown { left: Mutex::new(50), ran: AtomicUsize::new(0) })).collect();
        for t in &tasks {
            let t: Arc<dyn Task> = t.clone();
            pool.push(&t, 2, false);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while tasks.iter().any(|t| t.ran.load(Ordering::SeqCst) < 50) {
            assert!(Instant::now() < deadline, "tasks did not finish");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(tasks.iter().all(|t| t.ran.load(Ordering::SeqCst) == 50));
        pool.stop();
    }

    /// Small tasks wake nobody while a worker is awake; they must still all run, whether they
    /// arrive back to back (a worker polls), while one runs, or after every worker slept.
    #[test]
    fn small_tasks_are_never_left_behind() {
        let pool = CopyPool::start(3, None).unwrap();
        let task = Arc::new(Countdown { left: Mutex::new(0), ran: AtomicUsize::new(0) });
        let mut pushed = 0u32;
        for round in 0..200u32 {
            *task.left.lock().unwrap() += 1;
            pushed += 1;
            let t: Arc<dyn Task> = task.clone();
            pool.push(&t, 1, true);
            match round % 4 {
                0 => std::thread::sleep(SPIN * 3), // every worker asleep before the next
                1 => std::thread::sleep(SPIN / 4),
                _ => {}
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while task.ran.load(Ordering::SeqCst) < pushed as usize {
            assert!(
                Instant::now() < deadline,
                "{} of {pushed} small tasks ran",
                task.ran.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        pool.stop();
    }
}
