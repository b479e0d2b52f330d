//! A device's queue type and immutable target, as the kernel keeps them
//! across table reloads (dm-ioctl.c `table_load`, dm-table.c
//! `dm_table_determine_type`): a device is bio-based or request-based from
//! its first table on, and a table with an immutable target (multipath)
//! can only be replaced by one with the same target or with a wildcard
//! target (error). blkstack maps every table bio by bio; the type is
//! kept only so that the same reloads are refused.

use crate::error::DmError;
use crate::table::Table;

/// dm's `enum dm_queue_mode`, as far as a reload can tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueType {
    /// Bio-based (`DM_TYPE_BIO_BASED`): how every blkstack table maps.
    Bio,
    /// Request-based (`DM_TYPE_REQUEST_BASED`): what a multipath table makes
    /// a device, so that a later table must be request-based too.
    Request,
}

/// Whether a multipath line's features ask for `queue_mode bio`.
fn multipath_is_bio(args: &[String]) -> bool {
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(0);
    let features = args
        .get(1..=n.min(args.len().saturating_sub(1)))
        .unwrap_or(&[]);
    features
        .windows(2)
        .any(|w| w[0].eq_ignore_ascii_case("queue_mode") && w[1].eq_ignore_ascii_case("bio"))
}

/// dm_table_determine_type: request-based for a request-based multipath,
/// none of its own for a table of only hybrid targets (error, which
/// inherits the device's type), bio-based otherwise.
pub fn of(t: &Table) -> Option<QueueType> {
    let mut hybrid_only = true;
    for e in &t.entries {
        match e.line.target.as_str() {
            "error" => {}
            "multipath" if !multipath_is_bio(&e.line.args) => return Some(QueueType::Request),
            _ => hybrid_only = false,
        }
    }
    (!hybrid_only).then_some(QueueType::Bio)
}

fn has(t: &Table, target: &str) -> bool {
    t.entries.iter().any(|e| e.line.target == target)
}

/// dm-ioctl.c `table_load`'s checks of a reload of a device whose type is
/// `dev_type` and whose live table is `live`.
pub fn check_reload(
    name: &str,
    dev_type: QueueType,
    live: &Table,
    new: &Table,
) -> Result<(), DmError> {
    if has(live, "multipath") && !has(new, "multipath") && !has(new, "error") {
        return Err(DmError::TableType {
            name: name.to_string(),
            why: "can't replace immutable target type multipath".into(),
        });
    }
    match of(new) {
        Some(t) if t != dev_type => Err(DmError::TableType {
            name: name.to_string(),
            why: format!("can't change device type ({dev_type:?}-based vs {t:?}-based) after initial table load"),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use crate::Registry;

    const MP_RQ: &str = "0 64 multipath 0 0 1 1 round-robin 0 1 0 l";
    const MP_BIO: &str = "0 64 multipath 2 queue_mode bio 0 1 1 round-robin 0 1 0 l";

    fn reload(reg: &Registry, table: &str) -> bool {
        let ok = reg.reload("d", table).is_ok();
        if ok {
            reg.resume("d").unwrap();
        }
        ok
    }

    #[test]
    fn reloads_follow_dm_ioctl_table_load() {
        let reg = Registry::new();
        reg.create("l", "0 64 zero").unwrap();
        // A request-based multipath device: only multipath (rq) or a table
        // of error lines replaces it.
        reg.create("d", MP_RQ).unwrap();
        assert!(
            !reload(&reg, "0 64 linear l 0"),
            "immutable target replaced"
        );
        assert!(!reload(&reg, MP_BIO), "request-based device made bio-based");
        assert!(
            !reload(&reg, "0 32 linear l 0\n32 32 error"),
            "type changed"
        );
        assert!(reload(&reg, "0 64 error"), "the wildcard error target");
        assert!(!reload(&reg, "0 64 linear l 0"), "still request-based");
        assert!(reload(&reg, MP_RQ));
        reg.remove("d", false).unwrap();
        // A bio-based device: a bio-based multipath may come and go with
        // an error line.
        reg.create("d", "0 64 linear l 0").unwrap();
        assert!(!reload(&reg, MP_RQ), "bio-based device made request-based");
        assert!(reload(&reg, MP_BIO));
        assert!(!reload(&reg, "0 64 zero"), "immutable target replaced");
        assert!(reload(&reg, "0 32 zero\n32 32 error"));
        assert!(reload(&reg, "0 64 zero"));
    }
}
