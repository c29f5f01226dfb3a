//! Placeholder until the async server example lands.

fn main() {}
