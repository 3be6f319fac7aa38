//! The context a backend runs in: the device's primary context, or one side of an SM split
//! (`--sm-split`), a green context holding only that side's SMs (driver API, CUDA 12.4 and
//! later).
//!
//! A green context shares the primary context's memory, so buffers made in one are valid in
//! the other; work launched in it runs on its SMs only. The backend makes everything (its
//! modules, cuBLAS handle, streams, buffers) in the context it is given, so a backend built
//! on one side of a split runs entirely on that side's SMs. Both sides of one split are
//! made together, once per process, so the prefill and decode engines of a node get
//! complementary groups.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::device::drv;
use crate::backend::error::GreenContextError;
use crate::backend::sm_split::{ResolvedSplit, SmFigures, SmPartition, SmSide, SmSplit};
use crate::error::Result;

/// Green contexts came with CUDA 12.4 (driver version 12040).
const GREEN_MIN_DRIVER: i32 = 12040;

/// The context for a backend on device `ordinal`: its side of `part`'s split, else the
/// primary context.
pub fn context(ordinal: usize, part: Option<SmPartition>) -> Result<Arc<CudaContext>> {
    let Some(part) = part else {
        return CudaContext::new(ordinal).map_err(|e| drv("context creation", e));
    };
    static SPLITS: OnceLock<Mutex<HashMap<(usize, SmSplit), Split>>> = OnceLock::new();
    let mut splits = SPLITS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(s) = splits.get(&(ordinal, part.split)) {
        return Ok(s.side(part.side));
    }
    let s = Split::create(ordinal, part.split)?;
    let ctx = s.side(part.side);
    tracing::info!(
        device = ordinal,
        prefill_sms = s.resolved.prefill,
        decode_sms = s.resolved.decode,
        "SMs split between the prefill and decode engines (--sm-split {})",
        part.split
    );
    splits.insert((ordinal, part.split), s);
    Ok(ctx)
}

/// The SM counts of `part`'s split on device `ordinal`, as made (after [`context`]).
pub fn resolved(ordinal: usize, split: SmSplit) -> Result<ResolvedSplit> {
    let primary = CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
    let (all, _) = device_sms(&primary)?;
    Ok(split.resolve(figures(&all))?)
}

/// Both sides of one split, kept for the process's life.
struct Split {
    prefill: Arc<CudaContext>,
    decode: Arc<CudaContext>,
    resolved: ResolvedSplit,
    /// Green contexts retain the primary context; holding it too keeps its start-up from
    /// being paid again whenever a side's last user goes.
    _primary: Arc<CudaContext>,
}

impl Split {
    fn side(&self, side: SmSide) -> Arc<CudaContext> {
        match side {
            SmSide::Prefill => self.prefill.clone(),
            SmSide::Decode => self.decode.clone(),
        }
    }

    fn create(ordinal: usize, split: SmSplit) -> Result<Split> {
        let primary = CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
        let mut version = 0i32;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| drv("driver version query", e))?;
        if version < GREEN_MIN_DRIVER {
            return Err(GreenContextError::OldDriver { driver: version }.into());
        }
        let (all, dev) = device_sms(&primary)?;
        let r = split.resolve(figures(&all))?;
        let want = r.count(r.cut);
        let mut group = MaybeUninit::<sys::CUdevResource>::zeroed();
        let mut rest = MaybeUninit::<sys::CUdevResource>::zeroed();
        let mut groups = 1u32;
        // SAFETY: one result slot for one group, the input read, the remainder written.
        unsafe {
            sys::cuDevSmResourceSplitByCount(
                group.as_mut_ptr(),
                &mut groups,
                &all,
                rest.as_mut_ptr(),
                0,
                want,
            )
        }
        .result()
        .map_err(|e| drv("splitting the SMs", e))?;
        // SAFETY: written by the call above (zeroed before, in any case).
        let (group, rest) = unsafe { (group.assume_init(), rest.assume_init()) };
        // SAFETY: SM resources: the `sm` member is the one the driver fills.
        let got = unsafe {
            (
                group.__bindgen_anon_1.sm.smCount,
                rest.__bindgen_anon_1.sm.smCount,
            )
        };
        if groups != 1 || got.0 != want {
            return Err(GreenContextError::Mismatch {
                split,
                want,
                groups,
                got: got.0,
                left: got.1,
            }
            .into());
        }
        let cut = green_context(ordinal, dev, group)?;
        let other = green_context(ordinal, dev, rest)?;
        let (prefill, decode) = match r.cut {
            SmSide::Prefill => (cut, other),
            SmSide::Decode => (other, cut),
        };
        Ok(Split {
            prefill,
            decode,
            resolved: r,
            _primary: primary,
        })
    }
}

/// The device's SMs as one resource, and the device.
fn device_sms(primary: &CudaContext) -> Result<(sys::CUdevResource, sys::CUdevice)> {
    let dev = primary.cu_device();
    let mut all = MaybeUninit::<sys::CUdevResource>::zeroed();
    // SAFETY: the driver fills one resource of the SM type.
    unsafe {
        sys::cuDeviceGetDevResource(
            dev,
            all.as_mut_ptr(),
            sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
        )
    }
    .result()
    .map_err(|e| drv("querying the device's SMs", e))?;
    // SAFETY: written above.
    Ok((unsafe { all.assume_init() }, dev))
}

fn figures(all: &sys::CUdevResource) -> SmFigures {
    // SAFETY: an SM resource, as asked for in `device_sms`.
    let sm = unsafe { all.__bindgen_anon_1.sm };
    SmFigures {
        total: sm.smCount,
        min_partition: sm.minSmPartitionSize,
        alignment: sm.smCoscheduledAlignment,
    }
}

/// A green context of `res`'s SMs, as a context the rest of the backend uses like any other.
fn green_context(
    ordinal: usize,
    dev: sys::CUdevice,
    mut res: sys::CUdevResource,
) -> Result<Arc<CudaContext>> {
    let mut desc: sys::CUdevResourceDesc = std::ptr::null_mut();
    let mut green: sys::CUgreenCtx = std::ptr::null_mut();
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: one resource described; the green context made from the description, on the
    // device whose resource it is; its CUcontext handle read.
    unsafe {
        sys::cuDevResourceGenerateDesc(&mut desc, &mut res, 1)
            .result()
            .map_err(|e| drv("describing an SM group", e))?;
        sys::cuGreenCtxCreate(
            &mut green,
            desc,
            dev,
            sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32,
        )
        .result()
        .map_err(|e| drv("creating a green context", e))?;
        sys::cuCtxFromGreenCtx(&mut ctx, green)
            .result()
            .map_err(|e| drv("converting a green context", e))?;
    }
    // SAFETY: a valid context of device `dev`.
    let c = unsafe { CudaContext::from_raw_context(ordinal, dev, ctx) }
        .map_err(|e| drv("binding a green context", e))?;
    // The wrapper would end the context with cuCtxDestroy, which is not how a green context
    // ends (cuGreenCtxDestroy is). Splits last as long as the process, so this context is
    // never dropped: one reference is left behind on purpose.
    std::mem::forget(c.clone());
    Ok(c)
}
