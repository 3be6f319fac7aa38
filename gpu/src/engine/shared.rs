//! Engines on a shared driver: a few threads and one timer carry thousands of engines whose
//! backend models a step's time instead of spending it (`sim`), where each would otherwise
//! sleep on a thread of its own. An engine is driven in turns (see `Engine::turn`): a turn
//! ends the step whose time is up, reads the commands that came meanwhile and computes the
//! next step, whose modelled time the driver then waits out on its timer before the step's
//! tokens go out. Every engine keeps its own scheduler, blocks and channel; only the threads
//! and the waiting are shared.
//!
//! Commands are read between steps, as on an engine's own thread. Transfers of a deferred
//! step's KV hear of all its layers at the step's end (an engine thread tells of each layer
//! as it is computed).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::handle::EngineHandle;
use super::request::EngineConfig;
use super::thread::{build, Engine, Turn};
use crate::backend::Backend;

/// Threads that drive a pool's engines, and its timer. Like an engine's own thread, they
/// live as long as the process.
pub struct EnginePool {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when an engine becomes ready or an earlier deadline is set.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    engines: Vec<Slot>,
    ready: VecDeque<usize>,
    /// (deadline, engine): steps whose time runs out then.
    timers: BinaryHeap<Reverse<(Instant, usize)>>,
}

struct Slot {
    /// Out of its slot while a driver thread runs its turn.
    engine: Option<Box<Engine>>,
    run: Run,
    /// A command came while its turn ran: it is read in another turn.
    notified: bool,
    /// When its last step's time ran out. A step that starts late (the driver woke late)
    /// ends as long after that as the model says, so lateness is paid back, as a sleeping
    /// engine's overshoot is.
    last_due: Instant,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Run {
    /// Waits for a command.
    Idle,
    Ready,
    Running,
    /// Its step's time is not up.
    Timed,
}

/// The most lateness paid back by later steps' time (as `Overshoot` caps a sleeping sim's).
pub(super) const MAX_OWED: Duration = Duration::from_millis(1);

impl EnginePool {
    /// A pool driven by `threads` threads (at least one).
    pub fn new(threads: usize) -> EnginePool {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        for i in 0..threads.max(1) {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("kvmesh-engines-{i}"))
                .spawn(move || drive(shared))
                .expect("spawn engine driver thread");
        }
        EnginePool { shared }
    }

    /// Engines driven by this pool so far.
    pub fn len(&self) -> usize {
        self.shared.state.lock().expect("engine pool").engines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts an engine on this pool. Its backend hands its steps' time to the pool where it
    /// can (`Backend::defer_steps`); one that cannot computes its steps on a driver thread.
    pub fn spawn(
        &self,
        backend: Box<dyn Backend>,
        cfg: EngineConfig,
        eos_ids: Vec<u32>,
        vocab_size: usize,
    ) -> EngineHandle {
        let id = {
            let mut st = self.shared.state.lock().expect("engine pool");
            st.engines.push(Slot {
                engine: None,
                run: Run::Running,
                notified: false,
                last_due: Instant::now(),
            });
            st.engines.len() - 1
        };
        let weak = Arc::downgrade(&self.shared);
        let wake = Arc::new(move || {
            if let Some(shared) = weak.upgrade() {
                shared.wake(id);
            }
        });
        let (engine, handle) = build(backend, cfg, eos_ids, vocab_size, Some(wake));
        // In place, it takes a first turn if a command came while it was built.
        self.shared.done(id, Box::new(engine), Turn::Idle);
        handle
    }
}

impl Shared {
    /// A command was sent to engine `id`.
    fn wake(&self, id: usize) {
        let mut st = self.state.lock().expect("engine pool");
        let slot = &mut st.engines[id];
        match slot.run {
            Run::Idle => {
                slot.run = Run::Ready;
                st.ready.push_back(id);
                drop(st);
                self.changed.notify_one();
            }
            Run::Running => slot.notified = true,
            // A ready engine reads it on its turn; a timed one after its step.
            Run::Ready | Run::Timed => {}
        }
    }

    /// Engine `id`'s turn ended with `turn`.
    fn done(&self, id: usize, engine: Box<Engine>, turn: Turn) {
        let mut st = self.state.lock().expect("engine pool");
        let now = Instant::now();
        let slot = &mut st.engines[id];
        slot.engine = Some(engine);
        let notified = std::mem::take(&mut slot.notified);
        match turn {
            Turn::Due(t) => {
                let floor = now.checked_sub(MAX_OWED).unwrap_or(now);
                let due = slot.last_due.max(floor) + t;
                slot.last_due = due;
                slot.run = Run::Timed;
                let earliest = st.timers.peek().is_none_or(|Reverse((d, _))| due < *d);
                st.timers.push(Reverse((due, id)));
                drop(st);
                if earliest {
                    self.changed.notify_one();
                }
            }
            Turn::Idle if !notified => slot.run = Run::Idle,
            Turn::Idle | Turn::Again => {
                slot.run = Run::Ready;
                st.ready.push_back(id);
                drop(st);
                self.changed.notify_one();
            }
        }
    }

    /// The next engine to take a turn, waiting for one.
    fn next(&self) -> (usize, Box<Engine>) {
        let mut st = self.state.lock().expect("engine pool");
        loop {
            let now = Instant::now();
            while let Some(&Reverse((due, id))) = st.timers.peek() {
                if due > now {
                    break;
                }
                st.timers.pop();
                st.engines[id].run = Run::Ready;
                st.ready.push_back(id);
            }
            if let Some(id) = st.ready.pop_front() {
                let slot = &mut st.engines[id];
                slot.run = Run::Running;
                let engine = slot.engine.take().expect("a ready engine is in its slot");
                if !st.ready.is_empty() || !st.timers.is_empty() {
                    // Another thread may take the rest.
                    self.changed.notify_one();
                }
                return (id, engine);
            }
            st = match st.timers.peek() {
                Some(&Reverse((due, _))) => {
                    self.changed
                        .wait_timeout(st, due.saturating_duration_since(now))
                        .expect("engine pool")
                        .0
                }
                None => self.changed.wait(st).expect("engine pool"),
            };
        }
    }
}

/// A driver thread: takes engines' turns.
fn drive(shared: Arc<Shared>) {
    loop {
        let (id, mut engine) = shared.next();
        let turn = engine.turn();
        shared.done(id, engine, turn);
    }
}
