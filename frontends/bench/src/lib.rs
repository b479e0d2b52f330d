//! Bench runner.
