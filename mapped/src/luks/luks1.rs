//! The LUKS1 binary header (cryptsetup lib/luks1/luks.h `struct
//! luks_phdr`, 592 bytes, big-endian): cipher name and mode, hash, payload
//! offset, key size, master key digest, UUID and eight keyslots.

use super::af::Hash;
use super::{corrupt, hex_lines, Header, Kdf, KeyDigest, Keyslot, LuksError, Segment};
use std::fmt::Write as _;

const SLOT_ACTIVE: u32 = 0x00AC_71F3;
const SLOT_INACTIVE: u32 = 0x0000_DEAD;

fn be32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// A NUL-terminated ASCII field.
fn text(b: &[u8], off: usize, len: usize, what: &str) -> Result<String, LuksError> {
    let f = &b[off..off + len];
    let end = f
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| corrupt(format!("{what} is not NUL-terminated")))?;
    let s = std::str::from_utf8(&f[..end]).map_err(|_| corrupt(format!("{what} is not text")))?;
    if !s.bytes().all(|c| c.is_ascii_graphic()) {
        return Err(corrupt(format!("{what} '{}'", s.escape_default())));
    }
    Ok(s.to_string())
}

/// Parse the first 4 KiB of a LUKS1 image.
pub fn parse(b: &[u8]) -> Result<Header, LuksError> {
    let cipher = text(b, 8, 32, "cipher name")?;
    let mode = text(b, 40, 32, "cipher mode")?;
    let hash_name = text(b, 72, 32, "hash spec")?;
    let hash = Hash::parse(&hash_name)?;
    let payload = be32(b, 104) as u64;
    let key_size = be32(b, 108) as usize;
    let uuid = text(b, 168, 40, "UUID")?;
    let digest = KeyDigest {
        hash,
        hash_name: hash_name.clone(),
        iterations: be32(b, 164),
        salt: b[132..164].to_vec(),
        digest: b[112..132].to_vec(),
    };
    let encryption = format!("{cipher}-{mode}");
    let mut keyslots = Vec::new();
    let mut states = Vec::new();
    for i in 0..8 {
        let o = 208 + i * 48;
        let active = match be32(b, o) {
            SLOT_ACTIVE => true,
            SLOT_INACTIVE => false,
            v => return Err(corrupt(format!("keyslot {i} state {v:#x}"))),
        };
        states.push(active);
        if !active {
            continue;
        }
        let area = be32(b, o + 40) as u64 * 512;
        let stripes = be32(b, o + 44) as usize;
        keyslots.push(Keyslot {
            id: i as u32,
            key_size,
            kdf: Kdf::Pbkdf2 {
                hash,
                iterations: be32(b, o + 4),
                salt: b[o + 8..o + 40].to_vec(),
            },
            stripes,
            af_hash: hash,
            area_offset: area,
            area_size: (key_size.saturating_mul(stripes)).div_ceil(512) as u64 * 512,
            encryption: encryption.clone(),
            area_key_size: key_size,
            priority: "normal".into(),
        });
    }
    Ok(Header {
        version: 1,
        uuid,
        label: String::new(),
        subsystem: String::new(),
        epoch: 0,
        hdr_size: 0,
        keyslots_size: 0,
        keyslots,
        luks1_slots: states,
        digest,
        segment: Segment {
            offset: payload * 512,
            size: None,
            iv_tweak: 0,
            encryption,
            sector_size: 512,
        },
        key_size,
    })
}

/// `cryptsetup luksDump` of a LUKS1 header.
pub fn dump(h: &Header) -> String {
    let mut s = String::new();
    let (cipher, mode) = h
        .segment
        .encryption
        .split_once('-')
        .unwrap_or((&h.segment.encryption, ""));
    let ind = "\t               \t";
    let _ = writeln!(s, "LUKS header information for IMAGE\n");
    let _ = writeln!(s, "Version:       \t1");
    let _ = writeln!(s, "Cipher name:   \t{cipher}");
    let _ = writeln!(s, "Cipher mode:   \t{mode}");
    let _ = writeln!(s, "Hash spec:     \t{}", h.digest.hash_name);
    let _ = writeln!(s, "Payload offset:\t{}", h.segment.offset / 512);
    let _ = writeln!(s, "MK bits:       \t{}", h.key_size * 8);
    // The 20-byte digest on one line, the salts 16 bytes a line.
    let _ = writeln!(
        s,
        "MK digest:     \t{}",
        hex_lines(&h.digest.digest, "").replace('\n', "")
    );
    let _ = writeln!(s, "MK salt:       \t{}", hex_lines(&h.digest.salt, ind));
    let _ = writeln!(s, "MK iterations: \t{}", h.digest.iterations);
    let _ = writeln!(s, "UUID:          \t{}\n", h.uuid);
    let mut slots = h.keyslots.iter();
    for (i, on) in h.luks1_slots.iter().enumerate() {
        if !on {
            let _ = writeln!(s, "Key Slot {i}: DISABLED");
            continue;
        }
        let Some(k) = slots.next() else { break };
        let _ = writeln!(s, "Key Slot {i}: ENABLED");
        if let Kdf::Pbkdf2 {
            iterations, salt, ..
        } = &k.kdf
        {
            let _ = writeln!(s, "\tIterations:         \t{iterations}");
            let _ = writeln!(
                s,
                "\tSalt:               \t{}",
                hex_lines(salt, "\t                      \t")
            );
        }
        let _ = writeln!(s, "\tKey material offset:\t{}", k.area_offset / 512);
        let _ = writeln!(s, "\tAF stripes:            \t{}", k.stripes);
    }
    s
}
