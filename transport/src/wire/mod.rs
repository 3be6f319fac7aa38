//! What travels between nodes: the messages ([`msg`]) and how each is framed on a stream
//! ([`frame`]). Framing knows nothing of the messages, and neither knows the transports that
//! carry them (`kv` imports `wire`, never the reverse).

pub mod frame;
pub mod fuzz;
pub mod msg;

pub use frame::{
    decode, encode, frame, frame_into, read_frame, read_msg, write_msg, Bounded, Encode,
    FIRST_READ, MAX_FRAME,
};
pub use msg::*;
