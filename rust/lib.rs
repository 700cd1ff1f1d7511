//! spillover's engine: the pinned host pool, the extent allocator under it, and (in `io`,
//! `tier`, `optim`, `link`) the swap engine, the tiered tensor store, the CPU optimizer and the
//! device link. No torch; CUDA only through the driver loaded at run time (`link::cuda`). Python
//! reaches it through `py` (feature "python").

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod error;
pub mod extent;
pub mod io;
pub mod link;
pub mod optim;
pub mod pool;
pub mod tier;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
