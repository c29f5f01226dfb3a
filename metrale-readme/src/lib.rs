//! Not published. The workspace README's code blocks, compiled as this crate's
//! doctests (`cargo test --workspace` runs them), so they cannot rot.

#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
mod readme {}
