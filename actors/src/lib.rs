//! A node's roles: the router (membership, connections to workers, routing policy) and the
//! worker (a local engine served over QUIC), each a ractor actor under the node supervisor.
//! Control and lifecycle go through the actors; tokens go through channels and streams.

pub mod convert;
pub mod kv_index;
pub mod pace;
pub mod policy;
pub mod router;
pub mod supervisor;
pub mod worker;

pub use kvmesh_discovery::Role;
pub use policy::Policy;
pub use router::{fetch_card_from, CardFetchError, Pinned, Pools, RouterCore};
pub use supervisor::{NodeMsg, NodeRoles, RoleRestarts};
pub use worker::{Serving, WorkerCore};

pub use ractor::ActorRef;
