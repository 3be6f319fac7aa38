//! The engine's mask thread: while the backend runs a step, it computes the grammar mask of
//! every guided sequence in the batch, and a backend about to sample waits only for the
//! mask of the row it samples (see [`MaskSlot`]). One long-lived thread: a step hands its
//! matchers over and takes them back, at the cost of two channel hand-offs, not a thread
//! start.

use std::sync::Arc;

use crate::backend::MaskSlot;
use crate::guided::Guided;

type Matchers = Vec<Option<Box<Guided>>>;

struct Job {
    guided: Matchers,
    slots: Arc<Vec<MaskSlot>>,
    words: usize,
}

/// The thread, started on first use.
#[derive(Default)]
pub(super) struct MaskThread {
    link: Option<(
        crossbeam_channel::Sender<Job>,
        crossbeam_channel::Receiver<Matchers>,
    )>,
}

/// Matchers away on the mask thread; [`Pending::wait`] takes them back.
pub(super) enum Pending<'a> {
    Away(&'a crossbeam_channel::Receiver<Matchers>),
    /// The thread could not be reached: computed here, already done.
    Done(Matchers),
}

impl Pending<'_> {
    pub(super) fn wait(self) -> Matchers {
        match self {
            Pending::Done(g) => g,
            // The thread always answers a job it took (it catches its own panics).
            Pending::Away(rx) => rx.recv().unwrap_or_default(),
        }
    }
}

impl MaskThread {
    /// Hands `guided` over to fill `slots` (slot `i` gets matcher `i`'s mask); with
    /// `inline`, fills them here and now instead.
    pub(super) fn start(
        &mut self,
        mut guided: Matchers,
        slots: Arc<Vec<MaskSlot>>,
        words: usize,
        inline: bool,
    ) -> Pending<'_> {
        if inline {
            compute_masks(&mut guided, &slots, words);
            return Pending::Done(guided);
        }
        if self.link.is_none() {
            let (jobs, job_rx) = crossbeam_channel::unbounded::<Job>();
            let (done_tx, done) = crossbeam_channel::unbounded();
            let spawned = std::thread::Builder::new()
                .name("kvmesh-masks".into())
                .stack_size(16 << 20)
                .spawn(move || {
                    for mut j in job_rx {
                        compute_masks(&mut j.guided, &j.slots, j.words);
                        if done_tx.send(j.guided).is_err() {
                            return;
                        }
                    }
                });
            if spawned.is_ok() {
                self.link = Some((jobs, done));
            }
        }
        let job = Job {
            guided,
            slots,
            words,
        };
        match &self.link {
            Some((tx, rx)) => match tx.send(job) {
                Ok(()) => Pending::Away(rx),
                Err(e) => {
                    let mut j = e.into_inner();
                    compute_masks(&mut j.guided, &j.slots, j.words);
                    Pending::Done(j.guided)
                }
            },
            None => {
                let mut j = job;
                compute_masks(&mut j.guided, &j.slots, j.words);
                Pending::Done(j.guided)
            }
        }
    }
}

/// Every guided sequence's mask into its slot, one after another. A slot is always filled,
/// with nothing allowed if its matcher failed (the engine then fails the sequence) or if
/// this panicked, so a backend waiting on it never hangs.
fn compute_masks(guided: &mut [Option<Box<Guided>>], slots: &[MaskSlot], words: usize) {
    let fill = std::panic::AssertUnwindSafe(|| {
        for (g, slot) in guided.iter_mut().zip(slots) {
            if let Some(g) = g {
                let mut m = Vec::with_capacity(words);
                g.fill_mask(&mut m);
                m.resize(words, 0);
                let _ = slot.set(m);
            }
        }
    });
    if std::panic::catch_unwind(fill).is_err() {
        tracing::error!("computing grammar masks panicked; the step's guided sequences fail");
    }
    for (g, slot) in guided.iter_mut().zip(slots) {
        if let Some(g) = g {
            if slot.set(vec![0; words]).is_ok() {
                g.poison("computing its mask panicked");
            }
        }
    }
}
