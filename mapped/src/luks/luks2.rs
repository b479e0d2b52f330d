//! The LUKS2 header (cryptsetup docs/on-disk-format-luks2.pdf,
//! lib/luks2/luks2.h): two binary headers each followed by a JSON area;
//! the one with a valid checksum and the higher sequence id is used.
//! From the JSON: keyslots (`luks2` type, `luks1` AF, raw area), the
//! `pbkdf2` digest, and the one `crypt` segment.

use super::af::Hash;
use super::{
    corrupt, hex_lines, read_at, Header, Image, Kdf, KeyDigest, Keyslot, LuksError, Segment,
};
use base64::Engine as _;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;

/// The header sizes the format allows (binary + JSON).
const HDR_SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];

fn be64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_be_bytes(a)
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// One binary header and its JSON, checked: (seqid, header bytes, json).
fn read_copy(f: &dyn Image, off: u64, size: u64) -> Result<(u64, Vec<u8>, Value), LuksError> {
    let bin = read_at(f, off, 4096, "a LUKS2 binary header")?;
    if bin[..6] != *b"LUKS\xba\xbe" && bin[..6] != *b"SKUL\xba\xbe" {
        return Err(corrupt(format!("no LUKS2 magic at {off}")));
    }
    let hdr_size = be64(&bin, 8);
    if !HDR_SIZES.contains(&hdr_size) || off + hdr_size > size {
        return Err(corrupt(format!("header size {hdr_size} at {off}")));
    }
    if cstr(&bin[72..104]) != "sha256" {
        return Err(LuksError::Unsupported(format!(
            "header checksum '{}' (sha256 is built)",
            cstr(&bin[72..104])
        )));
    }
    let mut all = read_at(f, off, hdr_size as usize, "the LUKS2 metadata")?;
    let csum = all[448..480].to_vec();
    all[448..512].fill(0);
    if Sha256::digest(&all)[..] != csum[..] {
        return Err(corrupt(format!("header checksum mismatch at {off}")));
    }
    let json = &all[4096..];
    let end = json
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| corrupt("JSON area is not NUL-terminated"))?;
    let v: Value =
        serde_json::from_slice(&json[..end]).map_err(|e| corrupt(format!("JSON metadata: {e}")))?;
    Ok((be64(&bin, 16), bin, v))
}

/// Parse a LUKS2 image: `first` is its first 4 KiB.
pub fn parse(f: &dyn Image, first: &[u8], size: u64) -> Result<Header, LuksError> {
    let primary = read_copy(f, 0, size);
    let second_off = be64(first, 8);
    let secondary = if HDR_SIZES.contains(&second_off) {
        read_copy(f, second_off, size)
    } else {
        Err(corrupt("no secondary header"))
    };
    let (seqid, bin, json) = match (primary, secondary) {
        (Ok(a), Ok(b)) => {
            if b.0 > a.0 {
                b
            } else {
                a
            }
        }
        (Ok(a), Err(_)) | (Err(_), Ok(a)) => a,
        (Err(e), Err(_)) => return Err(e),
    };
    let top = obj(&json, "metadata")?;
    let keyslots_size = num_str(get(top, "config", "metadata")?, "keyslots_size")?;
    let (digest, digest_slots, digest_segs) = digest(top)?;
    let segment = segment(top, &digest_segs)?;
    let mut keyslots = Vec::new();
    for (id, ks) in obj(get(top, "keyslots", "metadata")?, "keyslots")? {
        let id: u32 = id
            .parse()
            .map_err(|_| corrupt(format!("keyslot id '{id}'")))?;
        if id >= 32 {
            return Err(corrupt(format!("keyslot id {id}")));
        }
        if digest_slots.contains(&id.to_string()) {
            keyslots.push(keyslot(id, ks)?);
        }
    }
    let key_size = keyslots.first().map(|k| k.key_size).unwrap_or(0);
    Ok(Header {
        version: 2,
        uuid: cstr(&bin[168..208]),
        label: cstr(&bin[24..72]),
        subsystem: cstr(&bin[208..256]),
        epoch: seqid,
        hdr_size: be64(&bin, 8),
        keyslots_size,
        keyslots,
        luks1_slots: Vec::new(),
        digest,
        segment,
        key_size,
    })
}

fn obj<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>, LuksError> {
    v.as_object()
        .ok_or_else(|| corrupt(format!("{what} is not an object")))
}

fn get<'a>(m: &'a Map<String, Value>, k: &str, what: &str) -> Result<&'a Value, LuksError> {
    m.get(k)
        .ok_or_else(|| corrupt(format!("{what} has no '{k}'")))
}

fn string<'a>(v: &'a Value, k: &str) -> Result<&'a str, LuksError> {
    v.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| corrupt(format!("'{k}' missing or not a string")))
}

fn uint(v: &Value, k: &str) -> Result<u64, LuksError> {
    v.get(k)
        .and_then(Value::as_u64)
        .ok_or_else(|| corrupt(format!("'{k}' missing or not a number")))
}

fn u32_of(v: &Value, k: &str) -> Result<u32, LuksError> {
    u32::try_from(uint(v, k)?).map_err(|_| corrupt(format!("'{k}' too large")))
}

/// LUKS2 writes 64-bit sizes and offsets as decimal strings.
fn num_str(v: &Value, k: &str) -> Result<u64, LuksError> {
    string(v, k)?
        .parse()
        .map_err(|_| corrupt(format!("'{k}' is not a decimal number")))
}

fn b64(v: &Value, k: &str) -> Result<Vec<u8>, LuksError> {
    let s = string(v, k)?;
    if s.len() > 1024 {
        return Err(corrupt(format!("'{k}' too long")));
    }
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|_| corrupt(format!("'{k}' is not base64")))
}

fn names(v: &Value, k: &str) -> Result<Vec<String>, LuksError> {
    v.get(k)
        .and_then(Value::as_array)
        .ok_or_else(|| corrupt(format!("'{k}' missing or not a list")))?
        .iter()
        .map(|x| {
            x.as_str()
                .map(str::to_string)
                .ok_or_else(|| corrupt(format!("'{k}' holds a non-string")))
        })
        .collect()
}

/// The (first) pbkdf2 digest, with the keyslots and segments it covers.
fn digest(top: &Map<String, Value>) -> Result<(KeyDigest, Vec<String>, Vec<String>), LuksError> {
    let digests = obj(get(top, "digests", "metadata")?, "digests")?;
    let Some((_, d)) = digests.iter().next() else {
        return Err(corrupt("no digest"));
    };
    if string(d, "type")? != "pbkdf2" {
        return Err(LuksError::Unsupported(format!(
            "digest type '{}'",
            string(d, "type")?
        )));
    }
    let hash_name = string(d, "hash")?.to_string();
    Ok((
        KeyDigest {
            hash: Hash::parse(&hash_name)?,
            hash_name,
            iterations: u32_of(d, "iterations")?,
            salt: b64(d, "salt")?,
            digest: b64(d, "digest")?,
        },
        names(d, "keyslots")?,
        names(d, "segments")?,
    ))
}

fn segment(top: &Map<String, Value>, ids: &[String]) -> Result<Segment, LuksError> {
    let segs = obj(get(top, "segments", "metadata")?, "segments")?;
    if segs.len() != 1 {
        return Err(LuksError::Unsupported(format!(
            "{} segments (a volume in reencryption?): one crypt segment is built",
            segs.len()
        )));
    }
    let (id, s) = segs.iter().next().expect("one segment");
    if !ids.contains(id) || string(s, "type")? != "crypt" {
        return Err(LuksError::Unsupported(format!(
            "segment {id} of type '{}'",
            string(s, "type")?
        )));
    }
    if s.get("integrity").is_some() {
        return Err(LuksError::Unsupported(
            "segment with integrity (dm-integrity is not built)".into(),
        ));
    }
    let size = match string(s, "size")? {
        "dynamic" => None,
        n => Some(
            n.parse()
                .map_err(|_| corrupt(format!("segment size '{n}'")))?,
        ),
    };
    Ok(Segment {
        offset: num_str(s, "offset")?,
        size,
        iv_tweak: num_str(s, "iv_tweak")?,
        encryption: string(s, "encryption")?.to_string(),
        sector_size: u32_of(s, "sector_size")?,
    })
}

fn keyslot(id: u32, ks: &Value) -> Result<Keyslot, LuksError> {
    let what = |s: &str| format!("keyslot {id}: {s}");
    if string(ks, "type")? != "luks2" {
        return Err(LuksError::Unsupported(what("type is not luks2")));
    }
    let af = ks.get("af").ok_or_else(|| corrupt(what("no af")))?;
    let area = ks.get("area").ok_or_else(|| corrupt(what("no area")))?;
    let kdf = ks.get("kdf").ok_or_else(|| corrupt(what("no kdf")))?;
    if string(af, "type")? != "luks1" || string(area, "type")? != "raw" {
        return Err(LuksError::Unsupported(what("af or area type")));
    }
    let kdf = match string(kdf, "type")? {
        "pbkdf2" => Kdf::Pbkdf2 {
            hash: Hash::parse(string(kdf, "hash")?)?,
            iterations: u32_of(kdf, "iterations")?,
            salt: b64(kdf, "salt")?,
        },
        t @ ("argon2i" | "argon2id") => Kdf::Argon2 {
            id: t == "argon2id",
            time: u32_of(kdf, "time")?,
            memory: u32_of(kdf, "memory")?,
            cpus: u32_of(kdf, "cpus")?,
            salt: b64(kdf, "salt")?,
        },
        t => return Err(LuksError::Unsupported(what(&format!("kdf '{t}'")))),
    };
    let size = |v: &Value, k: &str| -> Result<usize, LuksError> {
        usize::try_from(uint(v, k)?).map_err(|_| corrupt(what(k)))
    };
    Ok(Keyslot {
        id,
        key_size: size(ks, "key_size")?,
        kdf,
        stripes: size(af, "stripes")?,
        af_hash: Hash::parse(string(af, "hash")?)?,
        area_offset: num_str(area, "offset")?,
        area_size: num_str(area, "size")?,
        encryption: string(area, "encryption")?.to_string(),
        area_key_size: size(area, "key_size")?,
        priority: match ks.get("priority").and_then(Value::as_u64) {
            Some(0) => "ignored".into(),
            Some(2) => "prefer".into(),
            _ => "normal".into(),
        },
    })
}

fn or_none(s: &str, none: &str) -> String {
    if s.is_empty() {
        none.to_string()
    } else {
        s.to_string()
    }
}

/// `cryptsetup luksDump` of a LUKS2 header, the fields blkstack reads.
pub fn dump(h: &Header) -> String {
    let mut s = String::new();
    let seg = &h.segment;
    let _ = writeln!(s, "LUKS header information");
    let _ = writeln!(s, "Version:       \t2");
    let _ = writeln!(s, "Epoch:         \t{}", h.epoch);
    let _ = writeln!(s, "Metadata area: \t{} [bytes]", h.hdr_size);
    let _ = writeln!(s, "Keyslots area: \t{} [bytes]", h.keyslots_size);
    let _ = writeln!(s, "UUID:          \t{}", h.uuid);
    let _ = writeln!(s, "Label:         \t{}", or_none(&h.label, "(no label)"));
    let _ = writeln!(
        s,
        "Subsystem:     \t{}",
        or_none(&h.subsystem, "(no subsystem)")
    );
    let _ = writeln!(s, "\nData segments:\n  0: crypt");
    let _ = writeln!(s, "\toffset: {} [bytes]", seg.offset);
    match seg.size {
        None => {
            let _ = writeln!(s, "\tlength: (whole device)");
        }
        Some(n) => {
            let _ = writeln!(s, "\tlength: {n} [bytes]");
        }
    }
    let _ = writeln!(s, "\tcipher: {}", seg.encryption);
    let _ = writeln!(s, "\tsector: {} [bytes]\n", seg.sector_size);
    let _ = writeln!(s, "Keyslots:");
    for k in &h.keyslots {
        let _ = writeln!(s, "  {}: luks2", k.id);
        let _ = writeln!(s, "\tKey:        {} bits", k.key_size * 8);
        let _ = writeln!(s, "\tPriority:   {}", k.priority);
        let _ = writeln!(s, "\tCipher:     {}", k.encryption);
        let _ = writeln!(s, "\tCipher key: {} bits", k.area_key_size * 8);
        let ind = "\t            ";
        match &k.kdf {
            Kdf::Pbkdf2 {
                iterations, salt, ..
            } => {
                let _ = writeln!(s, "\tPBKDF:      pbkdf2");
                let _ = writeln!(s, "\tIterations: {iterations}");
                let _ = writeln!(s, "\tSalt:       {}", hex_lines(salt, ind));
            }
            Kdf::Argon2 {
                id,
                time,
                memory,
                cpus,
                salt,
            } => {
                let t = if *id { "argon2id" } else { "argon2i" };
                let _ = writeln!(s, "\tPBKDF:      {t}");
                let _ = writeln!(s, "\tTime cost:  {time}");
                let _ = writeln!(s, "\tMemory:     {memory}");
                let _ = writeln!(s, "\tThreads:    {cpus}");
                let _ = writeln!(s, "\tSalt:       {}", hex_lines(salt, ind));
            }
        }
        let _ = writeln!(s, "\tAF stripes: {}", k.stripes);
        let _ = writeln!(s, "\tAF hash:    {}", k.af_hash.name());
        let _ = writeln!(s, "\tArea offset:{} [bytes]", k.area_offset);
        let _ = writeln!(s, "\tArea length:{} [bytes]", k.area_size);
        let _ = writeln!(s, "\tDigest ID:  0");
    }
    let _ = writeln!(s, "Digests:\n  0: pbkdf2");
    let d = &h.digest;
    let ind = "\t            ";
    let _ = writeln!(s, "\tHash:       {}", d.hash_name);
    let _ = writeln!(s, "\tIterations: {}", d.iterations);
    let _ = writeln!(s, "\tSalt:       {}", hex_lines(&d.salt, ind));
    let _ = writeln!(s, "\tDigest:     {}", hex_lines(&d.digest, ind));
    s
}
