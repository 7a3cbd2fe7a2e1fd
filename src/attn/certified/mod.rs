//! Certified sparse attention for decoding (seed 000): each query head reads
//! a perturbation-driven sample of the keys, estimates its attention output
//! without bias, and certifies how far the estimate can be from exact
//! attention's, per head and call, except with probability `δ`.
//!
//! The visible keys of a call split into the **exact set** (the attention
//! sinks and the newest [`WINDOW`](crate::attn::WINDOW) positions, always
//! read) and the **pool**
//! (the rest). Every pool key gets an Exp(1) perturbation `E_i`
//! ([`perturb`]); at threshold `τ` the sample is
//! `S(τ) = {i : s_i − c + E_i ≥ ln τ}`, which holds each key with
//! probability `min(1, w_i/τ)`, `w_i = e^{s_i − c}`: sampling proportional
//! to the attention weight. On a grid of thresholds ([`levels`]) the
//! Horvitz–Thompson estimates of the softmax's denominator and numerator
//! ([`estimate`]) are unbiased, and Chernoff and Hilbert-space Bernstein
//! bounds ([`certificate`]) give an error bound at each level that holds
//! for all levels at once. A head stops at the first level whose bound
//! meets `ε`, or falls back to exact attention ([`head`]).
//!
//! What the certificate promises: for one head and one call, the
//! probability that the call is certified *and* its error exceeds `ε` (in
//! the measure's units) is at most `δ`. Over `H` heads and `T` steps the
//! union bound gives `δ·H·T`; it is no promise that a generation is
//! unchanged.

pub mod candidates;
pub mod certificate;
pub mod estimate;
pub mod head;
pub mod levels;
pub mod perturb;
pub mod policy;
pub mod synthetic;

pub use certificate::LevelCertificate;
pub use head::{HeadAttention, HeadKeys, HeadRecord, Params, Stop};
pub use levels::Grid;
pub use perturb::{PerturbationSeed, Perturbations};
pub use policy::CertifiedPolicy;
