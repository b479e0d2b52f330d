//! Mapped devices.
