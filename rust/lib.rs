//! spillover's engine: the pinned host pool, the extent allocator under it, and (in `io`,
//! `store`, `prefetch`, `optim`) the swap tier and CPU optimizer. No torch, no CUDA; Python
//! reaches it through `py` (feature "python").

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod error;
pub mod extent;
pub mod io;
pub mod optim;
pub mod pool;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
