//! kvmesh's bench programs and test harness; the server does not depend on this crate
//! (`kvmesh bench`, the load generator, is `kvmesh-loadgen`). The programs in `src/bin/`
//! (engine, GPU, KV transfer, mesh, disaggregation, tracing, soak) print figures and write
//! JSON under `bench/results/`, with a prefill's arithmetic and the CPU's peak rates from
//! [`compute`];
//! the process harness those programs and the end-to-end tests start `kvmesh` with
//! ([`harness`]); and other projects' transfer tools, run beside kvmesh's transports by the KV
//! transfer bench for reference figures ([`kv_peers`]).

pub mod compute;
#[cfg(feature = "cuda")]
pub mod delta_peer;
pub mod harness;
pub mod kv_peers;
pub mod programs;
