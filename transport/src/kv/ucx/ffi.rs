//! UCX's UCP API, loaded at run time from `libucp.so.0` (Debian: `libucx0`), so building
//! needs no UCX headers and a node that never asks for UCX never loads it.
//!
//! Only what the KV transport calls is declared. The parameter structs are laid out as in
//! UCX 1.13's `ucp.h`; UCX keeps them binary compatible across releases (a field mask says
//! which fields are set, new fields are appended), so a newer library reads them the same.

#![allow(non_camel_case_types)]

use super::error::UcxError;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use libloading::Library;

pub type ucs_status_t = i8;
pub type Context = *mut c_void;
pub type Worker = *mut c_void;
pub type Ep = *mut c_void;
pub type MemH = *mut c_void;
pub type RKey = *mut c_void;
pub type Config = *mut c_void;
/// `ucs_status_ptr_t`: null (done), an error code, or a request.
pub type StatusPtr = *mut c_void;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
const UCS_ERR_LAST: isize = -100;

pub const UCS_MEMORY_TYPE_HOST: u32 = 0;
pub const UCS_MEMORY_TYPE_CUDA: u32 = 1;

pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCP_WORKER_PARAM_FIELD_EVENTS: u64 = 1 << 2;
pub const UCS_THREAD_MODE_SINGLE: u32 = 0;
pub const UCP_WAKEUP_RMA: u32 = 1 << 0;
pub const UCP_WAKEUP_TX: u32 = 1 << 10;
pub const UCP_WAKEUP_RX: u32 = 1 << 11;

pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_ERR_HANDLING_MODE_NONE: u32 = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: u32 = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;

pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;

pub const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;

/// `ucp_params_t` (80 bytes).
#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *const c_void,
    pub request_cleanup: *const c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_worker_params_t` (200 bytes).
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: u32,
    pub cpu_mask: [u64; 16],
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

pub type ErrHandlerCb = unsafe extern "C" fn(arg: *mut c_void, ep: Ep, status: ucs_status_t);

/// `ucp_ep_params_t` (104 bytes).
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: u32,
    pub err_handler_cb: Option<ErrHandlerCb>,
    pub err_handler_arg: *mut c_void,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: *const c_void,
    pub sockaddr_len: u32,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: *const c_void,
    pub local_sockaddr_len: u32,
}

/// `ucp_mem_map_params_t` (40 bytes).
#[repr(C)]
pub struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: u32,
}

pub type SendCb =
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user: *mut c_void);

/// `ucp_request_param_t` (72 bytes).
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: Option<SendCb>,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: u32,
    pub recv_info: *mut c_void,
    pub memh: MemH,
}

impl RequestParam {
    pub fn empty() -> RequestParam {
        // SAFETY: every field is an integer or a nullable pointer; all zero means "not set".
        unsafe { std::mem::zeroed() }
    }
}

/// `ucp_context_attr_t` (64 bytes).
#[repr(C)]
pub struct ContextAttr {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: u32,
    pub memory_types: u64,
    pub name: [c_char; 32],
}

/// Whether a `ucs_status_ptr_t` is an error, and which.
pub fn ptr_status(p: StatusPtr) -> Option<ucs_status_t> {
    let v = p as isize;
    if (UCS_ERR_LAST..0).contains(&v) {
        Some(v as ucs_status_t)
    } else {
        None
    }
}

macro_rules! ucp_fns {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The UCP functions the transport calls, resolved from the library.
        #[allow(non_snake_case)]
        pub struct Ucp {
            _lib: Library,
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Ucp {
            /// Every name the transport calls, for checking a library without using it.
            pub const SYMBOLS: &'static [&'static str] = &[$(stringify!($name)),*];

            fn resolve(lib: Library) -> Result<Ucp, UcxError> {
                // SAFETY: each symbol is declared with its C signature from ucp.h.
                unsafe {
                    $(let $name = *lib
                        .get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                            concat!(stringify!($name), "\0").as_bytes())
                        .map_err(|e| UcxError::Unavailable(format!("{} is missing from libucp: {e}", stringify!($name))))?;)*
                    Ok(Ucp { _lib: lib, $($name,)* })
                }
            }
        }
    };
}

ucp_fns! {
    ucp_get_version: fn(*mut c_uint, *mut c_uint, *mut c_uint);
    ucp_config_read: fn(*const c_char, *const c_char, *mut Config) -> ucs_status_t;
    ucp_config_release: fn(Config);
    ucp_config_modify: fn(Config, *const c_char, *const c_char) -> ucs_status_t;
    ucp_init_version: fn(c_uint, c_uint, *const Params, Config, *mut Context) -> ucs_status_t;
    ucp_cleanup: fn(Context);
    ucp_context_query: fn(Context, *mut ContextAttr) -> ucs_status_t;
    ucp_worker_create: fn(Context, *const WorkerParams, *mut Worker) -> ucs_status_t;
    ucp_worker_destroy: fn(Worker);
    ucp_worker_get_address: fn(Worker, *mut *mut c_void, *mut usize) -> ucs_status_t;
    ucp_worker_release_address: fn(Worker, *mut c_void);
    ucp_worker_progress: fn(Worker) -> c_uint;
    ucp_worker_get_efd: fn(Worker, *mut c_int) -> ucs_status_t;
    ucp_worker_arm: fn(Worker) -> ucs_status_t;
    ucp_worker_signal: fn(Worker) -> ucs_status_t;
    ucp_ep_create: fn(Worker, *const EpParams, *mut Ep) -> ucs_status_t;
    ucp_ep_close_nbx: fn(Ep, *const RequestParam) -> StatusPtr;
    ucp_ep_print_info: fn(Ep, *mut libc::FILE);
    ucp_mem_map: fn(Context, *const MemMapParams, *mut MemH) -> ucs_status_t;
    ucp_mem_unmap: fn(Context, MemH) -> ucs_status_t;
    ucp_rkey_pack: fn(Context, MemH, *mut *mut c_void, *mut usize) -> ucs_status_t;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(Ep, *const c_void, *mut RKey) -> ucs_status_t;
    ucp_rkey_destroy: fn(RKey);
    ucp_put_nbx: fn(Ep, *const c_void, usize, u64, RKey, *const RequestParam) -> StatusPtr;
    ucp_ep_flush_nbx: fn(Ep, *const RequestParam) -> StatusPtr;
    ucp_request_check_status: fn(*mut c_void) -> ucs_status_t;
    ucp_request_free: fn(*mut c_void);
    ucs_status_string: fn(ucs_status_t) -> *const c_char;
}

/// The library file, and what to install where it is missing.
pub const LIBRARY: &str = "libucp.so.0";
pub const INSTALL_HINT: &str =
    "install UCX (Debian/Ubuntu: apt-get install libucx0; RHEL: dnf install ucx)";

impl Ucp {
    /// Loads `libucp.so.0` (or the file `KVMESH_UCX_LIB` names) and resolves every function.
    pub fn load() -> Result<Ucp, UcxError> {
        let path = std::env::var("KVMESH_UCX_LIB").unwrap_or_else(|_| LIBRARY.to_string());
        // SAFETY: loading UCX runs its constructors, which only set up its own state.
        let lib = unsafe { Library::new(&path) }.map_err(|e| {
            UcxError::Unavailable(format!(
                "UCX is not available ({path}: {e}); {INSTALL_HINT}"
            ))
        })?;
        Ucp::resolve(lib)
    }

    /// The library's version, e.g. `(1, 13, 1)`.
    pub fn version(&self) -> (u32, u32, u32) {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three out-parameters.
        unsafe { (self.ucp_get_version)(&mut a, &mut b, &mut c) };
        (a, b, c)
    }

    /// UCX's text for a status.
    pub fn status(&self, s: ucs_status_t) -> String {
        // SAFETY: ucs_status_string returns a static string for any value.
        let p = unsafe { (self.ucs_status_string)(s) };
        if p.is_null() {
            return format!("status {s}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `UCS_OK`, else the status and UCX's text for what `what` hit.
    pub fn check(&self, s: ucs_status_t, what: &str) -> Result<(), UcxError> {
        if s == UCS_OK {
            Ok(())
        } else {
            Err(self.error(s, what))
        }
    }

    /// The error for status `s` of `what`.
    pub fn error(&self, s: ucs_status_t, what: &str) -> UcxError {
        UcxError::Status {
            what: what.to_string(),
            code: s,
            text: self.status(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The structs' sizes and offsets, as UCX 1.13's headers give them on x86_64/aarch64.
    #[test]
    fn parameter_structs_match_ucp_h() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<Params>(), 80);
        assert_eq!(offset_of!(Params, name), 72);
        assert_eq!(size_of::<WorkerParams>(), 200);
        assert_eq!(offset_of!(WorkerParams, events), 144);
        assert_eq!(offset_of!(WorkerParams, name), 176);
        assert_eq!(offset_of!(WorkerParams, client_id), 192);
        assert_eq!(size_of::<EpParams>(), 104);
        assert_eq!(offset_of!(EpParams, err_mode), 16);
        assert_eq!(offset_of!(EpParams, err_handler_cb), 24);
        assert_eq!(offset_of!(EpParams, user_data), 40);
        assert_eq!(offset_of!(EpParams, flags), 48);
        assert_eq!(offset_of!(EpParams, name), 80);
        assert_eq!(size_of::<MemMapParams>(), 40);
        assert_eq!(offset_of!(MemMapParams, memory_type), 32);
        assert_eq!(size_of::<RequestParam>(), 72);
        assert_eq!(offset_of!(RequestParam, cb), 16);
        assert_eq!(offset_of!(RequestParam, user_data), 32);
        assert_eq!(offset_of!(RequestParam, memory_type), 48);
        assert_eq!(offset_of!(RequestParam, memh), 64);
        assert_eq!(size_of::<ContextAttr>(), 64);
        assert_eq!(offset_of!(ContextAttr, memory_types), 24);
    }

    #[test]
    fn status_pointers_decode() {
        assert_eq!(ptr_status(std::ptr::null_mut()), None);
        assert_eq!(ptr_status(-15isize as StatusPtr), Some(UCS_ERR_BUSY));
        assert_eq!(ptr_status(0x7f00_0000_1000usize as StatusPtr), None);
    }
}
