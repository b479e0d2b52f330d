//! Leaf drivers.
