//! Bitsets on disk (`persistent-data/dm-bitset.c`): an array
//! (`array.rs`) of `__le64` words, bit `i` in word `i / 64` at position
//! `i % 64`. dm-era's writesets are these.
//!
//! The kernel keeps the word it last touched in `struct dm_disk_bitset`
//! and writes it back on `dm_bitset_flush`; here each change goes to the
//! array at once, which leaves the same blocks on disk at the commit (the
//! word's array block is shadowed once per transaction either way).

use super::array;
use super::tm::Tm;
use super::value_type::Le64;
use super::PdError;

/// Bits in one array entry (`BITS_PER_ARRAY_ENTRY`).
pub const BITS_PER_WORD: u64 = 64;

/// Words holding `nr_bits` bits.
pub fn words(nr_bits: u64) -> u32 {
    nr_bits.div_ceil(BITS_PER_WORD) as u32
}

/// `dm_bitset_empty`.
pub fn empty(tm: &mut Tm) -> Result<u64, PdError> {
    array::empty(tm, &mut Le64)
}

/// `dm_bitset_del`.
pub fn del(tm: &mut Tm, root: u64) -> Result<(), PdError> {
    array::del(tm, root, &mut Le64)
}

/// `dm_bitset_resize`: from `old_bits` to `new_bits` bits, new words all
/// `default`; returns the new root.
pub fn resize(
    tm: &mut Tm,
    root: u64,
    old_bits: u64,
    new_bits: u64,
    default: bool,
) -> Result<u64, PdError> {
    let value = if default { u64::MAX } else { 0 };
    array::resize(
        tm,
        root,
        words(old_bits),
        words(new_bits),
        &mut Le64,
        &value,
    )
}

fn word(tm: &mut Tm, root: u64, bit: u64) -> Result<u64, PdError> {
    array::get::<Le64>(tm, root, bit / BITS_PER_WORD)?
        .ok_or_else(|| PdError::corrupt(root, &format!("bitset has no bit {bit}")))
}

/// `dm_bitset_test_bit`.
pub fn test_bit(tm: &mut Tm, root: u64, bit: u64) -> Result<bool, PdError> {
    Ok(word(tm, root, bit)? & (1 << (bit % BITS_PER_WORD)) != 0)
}

/// `dm_bitset_set_bit`; returns the new root.
pub fn set_bit(tm: &mut Tm, root: u64, bit: u64) -> Result<u64, PdError> {
    let w = word(tm, root, bit)?;
    let mask = 1 << (bit % BITS_PER_WORD);
    if w & mask != 0 {
        return Ok(root);
    }
    array::set(tm, root, bit / BITS_PER_WORD, &mut Le64, &(w | mask))
}

/// `dm_bitset_clear_bit`; returns the new root.
pub fn clear_bit(tm: &mut Tm, root: u64, bit: u64) -> Result<u64, PdError> {
    let w = word(tm, root, bit)?;
    let mask = 1 << (bit % BITS_PER_WORD);
    if w & mask == 0 {
        return Ok(root);
    }
    array::set(tm, root, bit / BITS_PER_WORD, &mut Le64, &(w & !mask))
}

/// The words of a bitset of `nr_bits` bits, read in one pass (a bitset
/// longer than that is refused as corrupt).
pub fn load(tm: &mut Tm, root: u64, nr_bits: u64) -> Result<Vec<u64>, PdError> {
    let n = words(nr_bits) as u64;
    let mut out = Vec::with_capacity(n as usize);
    array::walk::<Le64>(tm, root, n, &mut |_, w| out.push(w))?;
    out.resize(n as usize, 0);
    Ok(out)
}
