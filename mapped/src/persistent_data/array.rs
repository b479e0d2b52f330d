//! Arrays (`persistent-data/dm-array.c`): a fully populated btree keyed
//! by block index whose `__le64` values are the locations of array
//! blocks, each holding packed values of one size. The btree's values
//! are reference counted (a copied leaf takes one more reference to each
//! array block it points at; the last reference gone frees the block),
//! and an array block is shadowed like a node before a change, so a
//! crash finds the last committed array whole. dm-era's era array and
//! (through `bitset.rs`) its writesets are built on it; dm-cache's
//! mapping and hint arrays are too.
//!
//! On disk, byte-exact to the kernel: a 24-byte header (`struct
//! array_block`: csum, max_entries, nr_entries, value_size, blocknr),
//! then the values; checksummed from byte 4 with `ARRAY_CSUM_XOR`.
//! Every block but the last is full.
//!
//! The values an array holds must refer to nothing (the kernel's users,
//! era and cache, give `NULL` inc/dec): the value type's `inc`/`dec` are
//! called where dm-array calls them, but no user here relies on them.

use super::btree;
use super::btree_remove;
use super::checksum::{seal, verify};
use super::tm::Tm;
use super::value_type::{ValueType, MAX_VALUE_SIZE};
use super::{le32, le64, put32, put64, FormatError, PdError, BLOCK_SIZE};

/// `dm-array.c` CSUM_XOR.
pub const ARRAY_CSUM_XOR: u32 = 595846735;

/// Bytes of `struct array_block` before the values.
pub const HEADER_SIZE: usize = 24;

/// Values of `value_size` bytes an array block holds (`calc_max_entries`).
pub fn max_entries(value_size: usize) -> u32 {
    ((BLOCK_SIZE - HEADER_SIZE) / value_size) as u32
}

/// `array_block_check`: the block says it is block `at`, and its
/// checksum holds.
pub fn check(b: &[u8], at: u64) -> Result<(), FormatError> {
    let says = le64(b, 16);
    if says != at {
        return Err(FormatError::Location {
            what: "array block",
            block: at,
            says,
        });
    }
    verify(b, ARRAY_CSUM_XOR, "array block", at)
}

/// `array_block_prepare_for_write`: record the location, then seal.
fn seal_at(b: &mut [u8], at: u64) {
    put64(b, 16, at);
    seal(b, ARRAY_CSUM_XOR);
}

fn nr_entries(b: &[u8]) -> u32 {
    le32(b, 8)
}

fn entry(i: u32, size: usize) -> usize {
    HEADER_SIZE + i as usize * size
}

/// Refuse an array block whose header does not fit values of `V`.
fn check_shape<V: ValueType>(b: &[u8], at: u64) -> Result<(), PdError> {
    let (max, nr, size) = (le32(b, 4), le32(b, 8), le32(b, 12));
    if size as usize != V::SIZE || max != max_entries(V::SIZE) || nr > max {
        return Err(PdError::corrupt(
            at,
            &format!(
                "array block of {nr}/{max} values of {size} bytes, expected {}-byte values",
                V::SIZE
            ),
        ));
    }
    Ok(())
}

/// The btree's value type: array block locations whose references are
/// counted (`block_inc`, `block_dec`, `block_equal`).
pub struct Blocks<'a, V>(pub &'a mut V);

impl<V: ValueType> ValueType for Blocks<'_, V> {
    type Value = u64;
    const SIZE: usize = 8;
    fn unpack(b: &[u8]) -> u64 {
        le64(b, 0)
    }
    fn pack(v: &u64, out: &mut [u8]) {
        out[..8].copy_from_slice(&v.to_le_bytes());
    }
    fn inc(&mut self, tm: &mut Tm, b: &u64) -> Result<(), PdError> {
        tm.inc(*b)
    }
    fn dec(&mut self, tm: &mut Tm, b: &u64) -> Result<(), PdError> {
        if tm.meta.get(*b) == 1 {
            let raw = tm.raw_block(*b, &check)?;
            check_shape::<V>(&raw, *b)?;
            for i in 0..nr_entries(&raw) {
                let v = V::unpack(&raw[entry(i, V::SIZE)..]);
                self.0.dec(tm, &v)?;
            }
            tm.unqueue_raw(*b);
        }
        tm.dec(*b)?;
        Ok(())
    }
}

/// `dm_array_empty`: a new array of no values; returns its root.
pub fn empty<V: ValueType>(tm: &mut Tm, vt: &mut V) -> Result<u64, PdError> {
    btree::build(tm, &[], &mut Blocks(vt))
}

/// `dm_array_del`: drop a reference to the array at `root`.
pub fn del<V: ValueType>(tm: &mut Tm, root: u64, vt: &mut V) -> Result<(), PdError> {
    btree::del(tm, root, &mut Blocks(vt))
}

/// `alloc_ablock` + `fill_ablock` + `insert_ablock`: a new array block
/// of `nr` copies of `value` at block index `index`.
fn insert_new<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    index: u64,
    nr: u32,
    vt: &mut V,
    value: &V::Value,
) -> Result<u64, PdError> {
    let mut raw = vec![0u8; BLOCK_SIZE];
    put32(&mut raw, 4, max_entries(V::SIZE));
    put32(&mut raw, 12, V::SIZE as u32);
    fill(tm, &mut raw, nr, vt, value)?;
    let b = tm.new_raw(raw)?;
    reseal(tm, b);
    btree::insert_value(tm, root, index, &mut Blocks(vt), b)
}

/// `fill_ablock`: pad the block out to `new_nr` copies of `value`.
fn fill<V: ValueType>(
    tm: &mut Tm,
    raw: &mut [u8],
    new_nr: u32,
    vt: &mut V,
    value: &V::Value,
) -> Result<(), PdError> {
    let mut packed = [0u8; MAX_VALUE_SIZE];
    V::pack(value, &mut packed);
    for i in nr_entries(raw)..new_nr {
        vt.inc(tm, value)?;
        let at = entry(i, V::SIZE);
        raw[at..at + V::SIZE].copy_from_slice(&packed[..V::SIZE]);
    }
    put32(raw, 8, new_nr);
    Ok(())
}

/// `shadow_ablock`: the array block at block index `index`, made this
/// transaction's (copied if it was not), with the btree pointing at it.
/// Returns the new root and the block's location.
fn shadow_ablock<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    index: u64,
    vt: &mut V,
) -> Result<(u64, u64), PdError> {
    let b = btree::lookup::<Blocks<V>>(tm, root, index)?
        .ok_or_else(|| PdError::corrupt(root, &format!("array has no block {index}")))?;
    let (copy, shared) = tm.shadow_raw(b, &check)?;
    let raw = tm.raw_block(copy, &check_nothing)?;
    check_shape::<V>(&raw, b)?;
    if shared {
        for i in 0..nr_entries(&raw) {
            vt.inc(tm, &V::unpack(&raw[entry(i, V::SIZE)..]))?;
        }
    }
    if copy == b {
        return Ok((root, b));
    }
    reseal(tm, copy);
    // The shadow dropped the btree's reference to `b`; the insert below
    // drops it again when it overwrites the value (`__reinsert_ablock`).
    tm.inc(b)?;
    let root = btree::insert_value(tm, root, index, &mut Blocks(vt), copy)?;
    Ok((root, copy))
}

fn check_nothing(_: &[u8], _: u64) -> Result<(), FormatError> {
    Ok(())
}

/// Seal queued block `b` again after a change.
fn reseal(tm: &mut Tm, b: u64) {
    if let Some(raw) = tm.raw_mut(b) {
        seal_at(raw, b);
    }
}

/// `dm_array_resize`: grow or shrink the array from `old_len` to
/// `new_len` values, new ones set to `value`; returns the new root.
pub fn resize<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    old_len: u32,
    new_len: u32,
    vt: &mut V,
    value: &V::Value,
) -> Result<u64, PdError> {
    let max = max_entries(V::SIZE);
    let (old_full, old_last) = (old_len / max, old_len % max);
    let (new_full, new_last) = (new_len / max, new_len % max);
    let blocks = |full: u32, last: u32| full as u64 + (last > 0) as u64;
    let mut root = root;
    if new_len < old_len {
        // The kernel's `shrink` drops blocks only when the full ones
        // shrink, leaving a partial tail block behind when an array
        // shrinks to whole blocks (or to nothing); here every block past
        // the new end goes, removed in place as the kernel removes them
        // (`dm_btree_remove_leaves`), each losing its reference.
        let keep = blocks(new_full, new_last);
        let old = blocks(old_full, old_last);
        if keep < old {
            root = btree_remove::remove_range(
                tm,
                root,
                keep,
                u64::MAX,
                &mut Blocks(vt),
                &mut |_, _| {},
            )?
            .root;
        }
        if new_last > 0 {
            let (r, b) = shadow_ablock(tm, root, new_full as u64, vt)?;
            root = r;
            trim(tm, b, new_last, vt)?;
        }
        return Ok(root);
    }
    if new_len == old_len {
        return Ok(root);
    }
    if new_full > old_full {
        let mut first_new = old_full as u64;
        if old_last > 0 {
            root = extend_tail(tm, root, old_full as u64, max, vt, value)?;
            first_new += 1;
        }
        for i in first_new..new_full as u64 {
            root = insert_new(tm, root, i, max, vt, value)?;
        }
        if new_last > 0 {
            root = insert_new(tm, root, new_full as u64, new_last, vt, value)?;
        }
        Ok(root)
    } else if old_last > 0 {
        extend_tail(tm, root, old_full as u64, new_last, vt, value)
    } else {
        insert_new(tm, root, new_full as u64, new_last, vt, value)
    }
}

/// `grow_extend_tail_block`.
fn extend_tail<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    index: u64,
    new_nr: u32,
    vt: &mut V,
    value: &V::Value,
) -> Result<u64, PdError> {
    let (root, b) = shadow_ablock(tm, root, index, vt)?;
    let mut raw = tm.raw_block(b, &check_nothing)?;
    fill(tm, &mut raw, new_nr, vt, value)?;
    seal_at(&mut raw, b);
    if let Some(slot) = tm.raw_mut(b) {
        *slot = raw;
    }
    Ok(root)
}

/// `trim_ablock`: drop the values of block `b` past `new_nr`.
fn trim<V: ValueType>(tm: &mut Tm, b: u64, new_nr: u32, vt: &mut V) -> Result<(), PdError> {
    let mut raw = tm.raw_block(b, &check_nothing)?;
    for i in (new_nr..nr_entries(&raw)).rev() {
        vt.dec(tm, &V::unpack(&raw[entry(i, V::SIZE)..]))?;
    }
    put32(&mut raw, 8, new_nr);
    seal_at(&mut raw, b);
    if let Some(slot) = tm.raw_mut(b) {
        *slot = raw;
    }
    Ok(())
}

/// `dm_array_get_value`: value `index`, `None` past the end.
pub fn get<V: ValueType>(tm: &mut Tm, root: u64, index: u64) -> Result<Option<V::Value>, PdError> {
    let max = max_entries(V::SIZE) as u64;
    let Some(b) = btree::lookup::<Blocks<V>>(tm, root, index / max)? else {
        return Ok(None);
    };
    let raw = tm.raw_block(b, &check)?;
    check_shape::<V>(&raw, b)?;
    let i = (index % max) as u32;
    Ok((i < nr_entries(&raw)).then(|| V::unpack(&raw[entry(i, V::SIZE)..])))
}

/// `dm_array_set_value`: set value `index` (which must exist); returns
/// the new root.
pub fn set<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    index: u64,
    vt: &mut V,
    value: &V::Value,
) -> Result<u64, PdError> {
    let max = max_entries(V::SIZE) as u64;
    let (root, b) = shadow_ablock(tm, root, index / max, vt)?;
    let mut raw = tm.raw_block(b, &check_nothing)?;
    let i = (index % max) as u32;
    if i >= nr_entries(&raw) {
        return Err(PdError::corrupt(
            b,
            &format!("array index {index} is past the array's end"),
        ));
    }
    let at = entry(i, V::SIZE);
    let old = V::unpack(&raw[at..]);
    if !vt.equal(&old, value) {
        vt.dec(tm, &old)?;
        vt.inc(tm, value)?;
    }
    let mut packed = [0u8; MAX_VALUE_SIZE];
    V::pack(value, &mut packed);
    raw[at..at + V::SIZE].copy_from_slice(&packed[..V::SIZE]);
    seal_at(&mut raw, b);
    if let Some(slot) = tm.raw_mut(b) {
        *slot = raw;
    }
    Ok(root)
}

/// `dm_array_walk`: every value in index order, handed to `f` with its
/// index; at most `limit` values (the caller's bound on the array it
/// expects), an array longer than that is refused as corrupt.
pub fn walk<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    limit: u64,
    f: &mut dyn FnMut(u64, V::Value),
) -> Result<u64, PdError> {
    let max = max_entries(V::SIZE) as u64;
    let mut n = 0;
    for (k, b) in btree::walk::<Blocks<V>>(tm, root)? {
        if k * max != n {
            return Err(PdError::corrupt(
                b,
                &format!("array block {k} out of place"),
            ));
        }
        let raw = tm.raw_block(b, &check)?;
        check_shape::<V>(&raw, b)?;
        let nr = nr_entries(&raw) as u64;
        if n + nr > limit {
            return Err(PdError::corrupt(
                b,
                &format!("array longer than {limit} values"),
            ));
        }
        for i in 0..nr as u32 {
            f(n + i as u64, V::unpack(&raw[entry(i, V::SIZE)..]));
        }
        n += nr;
    }
    Ok(n)
}
