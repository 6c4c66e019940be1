//! Typed errors. Each names what was wrong (which tensor or option, which
//! axis, expected versus got), so a caller never has to guess, and no input
//! reaches a kernel without passing [`crate::Problem::validate`].

use crate::dtype::DType;
use std::fmt;

/// Everything an attn call can refuse or fail with.
#[derive(Clone, Debug, PartialEq)]
pub enum AttnError {
    /// A size that must be positive is zero.
    ZeroSize {
        /// Which size (e.g. `"head_dim_qk"`).
        what: &'static str,
    },
    /// Query heads are not a multiple of key/value heads.
    HeadsNotDivisible {
        /// Query heads.
        q_heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// A tensor's dimension differs from what the problem implies.
    Shape {
        /// The tensor (`"q"`, `"k"`, `"v"`, `"out"`, `"bias"`, `"mask"`, ...).
        tensor: &'static str,
        /// The axis name.
        axis: &'static str,
        /// The expected size (for broadcastable axes: the full size; 1 is
        /// also accepted).
        expected: usize,
        /// The size given.
        got: usize,
    },
    /// A buffer is shorter than its view reaches.
    BufferTooSmall {
        /// The tensor.
        tensor: &'static str,
        /// Elements the view needs.
        needed: usize,
        /// Elements the buffer has.
        len: usize,
    },
    /// A buffer has the wrong element type.
    DType {
        /// The tensor.
        tensor: &'static str,
        /// What was expected (e.g. `"f32"`, `"same as q"`).
        expected: String,
        /// What was given.
        got: DType,
    },
    /// A per-head or per-sequence option has the wrong length.
    OptionLength {
        /// The option (`"alibi_slopes"`, `"sinks"`, `"q_lens"`, `"kv_lens"`).
        option: &'static str,
        /// Expected length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// A per-sequence length exceeds the padded length.
    SeqLen {
        /// `"q_lens"` or `"kv_lens"`.
        option: &'static str,
        /// The batch entry.
        batch: usize,
        /// The length given.
        len: usize,
        /// The padded length it must not exceed.
        max: usize,
    },
    /// A scalar option has an invalid value.
    Parameter {
        /// The option.
        what: &'static str,
        /// The value given.
        value: f64,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// Size arithmetic overflowed `usize`.
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// An input tensor is present without its description, or vice versa.
    Missing {
        /// The tensor.
        tensor: &'static str,
        /// What is missing.
        what: &'static str,
    },
    /// The output view maps two elements to one place.
    Aliasing {
        /// The tensor.
        tensor: &'static str,
    },
    /// The backend cannot do this (no silent fallback).
    Unsupported {
        /// The backend's name.
        backend: String,
        /// The feature refused.
        feature: String,
        /// Why.
        reason: String,
    },
    /// No device is available (e.g. no GPU).
    NoDevice {
        /// The backend's name.
        backend: String,
        /// What was looked for.
        reason: String,
    },
    /// A driver or runtime library is missing.
    DriverMissing {
        /// The library.
        library: String,
    },
    /// Run-time compilation of a GPU kernel failed.
    Nvrtc {
        /// The kernel variant.
        variant: String,
        /// The compiler's log.
        log: String,
    },
    /// A selection names an index outside the problem (e.g. a head of an
    /// attention-map request).
    OutOfRange {
        /// What was selected (`"maps: batch"`, `"maps: head"`, ...).
        what: &'static str,
        /// The index given (for a row range: its end).
        index: usize,
        /// How many there are.
        len: usize,
    },
    /// A request needs more memory than the budget it was given.
    OverBudget {
        /// What would be allocated, with its dims.
        what: String,
        /// Bytes it needs.
        needed: u128,
        /// The budget in bytes.
        budget: u128,
        /// How to make it fit.
        hint: &'static str,
    },
    /// A backend-specific failure (launch, allocation, ...).
    Backend {
        /// The backend's name.
        backend: String,
        /// The message.
        message: String,
    },
}

impl fmt::Display for AttnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use AttnError::*;
        match self {
            ZeroSize { what } => write!(f, "{what} is 0; it must be at least 1"),
            HeadsNotDivisible { q_heads, kv_heads } => write!(
                f,
                "query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})"
            ),
            Shape {
                tensor,
                axis,
                expected,
                got,
            } => write!(
                f,
                "tensor `{tensor}`: axis `{axis}` has size {got}, expected {expected}"
            ),
            BufferTooSmall {
                tensor,
                needed,
                len,
            } => write!(
                f,
                "tensor `{tensor}`: its view needs {needed} elements but the buffer has {len}"
            ),
            DType {
                tensor,
                expected,
                got,
            } => write!(
                f,
                "tensor `{tensor}`: element type {got}, expected {expected}"
            ),
            OptionLength {
                option,
                expected,
                got,
            } => write!(f, "option `{option}`: {got} entries, expected {expected}"),
            SeqLen {
                option,
                batch,
                len,
                max,
            } => write!(
                f,
                "option `{option}`: batch entry {batch} has length {len}, more than the padded {max}"
            ),
            Parameter {
                what,
                value,
                reason,
            } => write!(f, "option `{what}` = {value}: {reason}"),
            Overflow { what } => write!(f, "size arithmetic overflowed computing {what}"),
            Missing { tensor, what } => write!(f, "tensor `{tensor}`: {what}"),
            Aliasing { tensor } => write!(
                f,
                "tensor `{tensor}`: its strides map two elements to one place"
            ),
            Unsupported {
                backend,
                feature,
                reason,
            } => write!(f, "backend `{backend}` does not support {feature}: {reason}"),
            NoDevice { backend, reason } => write!(f, "backend `{backend}`: no device: {reason}"),
            DriverMissing { library } => {
                write!(f, "driver library `{library}` is not installed or not found")
            }
            Nvrtc { variant, log } => {
                write!(f, "NVRTC failed to compile kernel {variant}:\n{log}")
            }
            OutOfRange { what, index, len } => write!(
                f,
                "{what} {index} is out of range: there are {len} (valid: 0..{len})"
            ),
            OverBudget {
                what,
                needed,
                budget,
                hint,
            } => write!(
                f,
                "{what} needs {}, over the budget of {}: {hint}",
                human_bytes(*needed),
                human_bytes(*budget)
            ),
            Backend { backend, message } => write!(f, "backend `{backend}`: {message}"),
        }
    }
}

impl std::error::Error for AttnError {}

/// `bytes` in the largest binary unit that keeps it at least 1 (e.g.
/// `4.00 GiB`).
pub fn human_bytes(bytes: u128) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{x:.2} {}", units[u])
    }
}

/// Result with [`AttnError`].
pub type Result<T, E = AttnError> = std::result::Result<T, E>;
