//! Tests of [`super`] (`proto.rs`), kept apart so that file stays short.

use super::*;

#[test]
fn request_round_trip() {
    let r = Request {
        flags: CMD_FLAG_FUA,
        cmd: CMD_WRITE,
        handle: 0xdead_beef_0102_0304,
        offset: 1 << 40,
        len: 4096,
    };
    assert_eq!(Request::parse(&r.encode()), Ok(r));
}

#[test]
fn request_bad_magic_is_an_error() {
    let mut b = Request {
        flags: 0,
        cmd: CMD_READ,
        handle: 1,
        offset: 0,
        len: 512,
    }
    .encode();
    b[0] ^= 0xff;
    assert!(matches!(
        Request::parse(&b),
        Err(WireError::BadMagic { .. })
    ));
}

#[test]
fn option_header_round_trip_and_bad_magic() {
    let h = OptionHeader {
        option: OPT_GO,
        len: 77,
    };
    let mut v = Vec::new();
    h.encode(&mut v);
    let arr: [u8; 16] = v.clone().try_into().expect("16 bytes");
    assert_eq!(OptionHeader::parse(&arr), Ok(h));
    let mut bad = arr;
    bad[3] = 0;
    assert!(OptionHeader::parse(&bad).is_err());
}

#[test]
fn go_request_round_trip() {
    let g = GoRequest {
        name: "disk0".into(),
        infos: vec![INFO_NAME, INFO_BLOCK_SIZE],
    };
    let mut v = Vec::new();
    g.encode(&mut v);
    assert_eq!(GoRequest::parse(&v), Ok(g));
}

#[test]
fn go_request_malformed() {
    // Name length larger than the data.
    let mut v = Vec::new();
    v.extend_from_slice(&100u32.to_be_bytes());
    v.extend_from_slice(b"abc");
    assert!(matches!(
        GoRequest::parse(&v),
        Err(WireError::Truncated { .. })
    ));
    // Info count promises more than present.
    let mut v = Vec::new();
    GoRequest {
        name: "a".into(),
        infos: vec![],
    }
    .encode(&mut v);
    let n = v.len();
    v[n - 2..].copy_from_slice(&3u16.to_be_bytes());
    assert!(GoRequest::parse(&v).is_err());
    // Trailing garbage.
    let mut v = Vec::new();
    GoRequest {
        name: "a".into(),
        infos: vec![1],
    }
    .encode(&mut v);
    v.push(9);
    assert!(matches!(
        GoRequest::parse(&v),
        Err(WireError::TrailingBytes { extra: 1, .. })
    ));
    // NUL and non-UTF-8 names.
    for name in [&b"a\0b"[..], &[0xff, 0xfe][..]] {
        let mut v = Vec::new();
        v.extend_from_slice(&(name.len() as u32).to_be_bytes());
        v.extend_from_slice(name);
        v.extend_from_slice(&0u16.to_be_bytes());
        assert!(GoRequest::parse(&v).is_err());
    }
    // Huge declared length is refused before any allocation.
    let mut v = Vec::new();
    v.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(
        GoRequest::parse(&v),
        Err(WireError::StringTooLong { .. })
    ));
}

#[test]
fn meta_request_round_trip_and_malformed() {
    let m = MetaRequest {
        export: "e".into(),
        queries: vec![BASE_ALLOCATION.into(), "base:".into()],
    };
    let mut v = Vec::new();
    m.encode(&mut v);
    assert_eq!(MetaRequest::parse(&v), Ok(m));
    v.truncate(v.len() - 1);
    assert!(MetaRequest::parse(&v).is_err());
}

#[test]
fn replies_decode_as_encoded() {
    let s = simple_reply(EINVAL, 42);
    assert_eq!(
        SimpleReply::parse(&s),
        Ok(SimpleReply {
            error: EINVAL,
            handle: 42
        })
    );
    let c = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 7, 10);
    assert_eq!(
        ChunkHeader::parse(&c),
        Ok(ChunkHeader {
            flags: REPLY_FLAG_DONE,
            typ: REPLY_TYPE_ERROR,
            handle: 7,
            len: 10
        })
    );
    let mut v = Vec::new();
    encode_option_reply(&mut v, OPT_LIST, REP_SERVER, b"xyz");
    let arr: [u8; 20] = v[..20].try_into().expect("20 bytes");
    assert_eq!(
        OptionReply::parse(&arr),
        Ok(OptionReply {
            option: OPT_LIST,
            rep: REP_SERVER,
            len: 3
        })
    );
    assert_eq!(&v[20..], b"xyz");
}

#[test]
fn error_chunk_layout() {
    let mut v = Vec::new();
    encode_error_chunk(&mut v, 5, EPERM, "read-only");
    let h = ChunkHeader::parse(&v[..20].try_into().expect("20")).expect("header");
    assert_eq!(h.len as usize, v.len() - 20);
    assert_eq!(u32::from_be_bytes(v[20..24].try_into().expect("4")), EPERM);
    assert_eq!(u16::from_be_bytes(v[24..26].try_into().expect("2")), 9);
    assert_eq!(&v[26..], b"read-only");
}

#[test]
fn hole_and_data_chunk_lengths() {
    let mut v = Vec::new();
    encode_hole_chunk(&mut v, 0, 1, 4096, 8192);
    assert_eq!(v.len(), 20 + 12);
    let h = ChunkHeader::parse(&v[..20].try_into().expect("20")).expect("header");
    assert_eq!((h.typ, h.len), (REPLY_TYPE_OFFSET_HOLE, 12));
    let mut v = Vec::new();
    encode_data_chunk_header(&mut v, REPLY_FLAG_DONE, 1, 0, 512);
    let h = ChunkHeader::parse(&v[..20].try_into().expect("20")).expect("header");
    assert_eq!((h.typ, h.len), (REPLY_TYPE_OFFSET_DATA, 520));
}

#[test]
fn block_status_chunk_layout() {
    let mut v = Vec::new();
    encode_block_status_chunk(
        &mut v,
        REPLY_FLAG_DONE,
        3,
        1,
        &[(512, STATE_HOLE), (1024, 0)],
    );
    let h = ChunkHeader::parse(&v[..20].try_into().expect("20")).expect("header");
    assert_eq!(h.len, 4 + 16);
    assert_eq!(v.len(), 20 + 20);
}

#[test]
fn export_name_reply_respects_no_zeroes() {
    let mut a = Vec::new();
    encode_export_name_reply(&mut a, 1 << 20, TFLAG_HAS_FLAGS, true);
    assert_eq!(a.len(), 10);
    let mut b = Vec::new();
    encode_export_name_reply(&mut b, 1 << 20, TFLAG_HAS_FLAGS, false);
    assert_eq!(b.len(), 134);
}

#[test]
fn status_maps_to_protocol_errors() {
    assert_eq!(nbd_error(Status::Ok), 0);
    assert_eq!(nbd_error(Status::Permission), EPERM);
    assert_eq!(nbd_error(Status::Invalid), EINVAL);
    assert_eq!(nbd_error(Status::Overflow), EOVERFLOW);
    assert_eq!(nbd_error(Status::Again), ENOTSUP);
    assert_eq!(nbd_error(Status::Medium), EIO);
}
