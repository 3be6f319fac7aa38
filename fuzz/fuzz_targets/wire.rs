//! The wire's decoders on whatever libFuzzer makes: every message type as a payload and as a
//! stream of frames (see kvmesh_transport::wire::fuzz).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvmesh_transport::wire::fuzz::decode_all(data);
});
