//! The `file` table line's words: `PATH [direct] [iopoll|hybrid_iopoll]
//! [create] [queue_depth=N] [engine=uring|psync] [reap_backstop_ms=N]`, parsed into
//! [`FileOptions`] and printed back canonically, so that `dmsetup table`
//! output parses back to the same device (as dm targets' `status`
//! STATUSTYPE_TABLE prints their constructor arguments).

use crate::args::KvArgs;
use crate::error::FileError;
use std::path::PathBuf;

/// Default number of requests one ring keeps in flight.
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;
const MAX_QUEUE_DEPTH: u64 = 4096;
/// Default of `reap_backstop_ms=` (the ring's `BACKSTOP`).
pub const DEFAULT_REAP_BACKSTOP_MS: u64 = 20;
const MAX_REAP_BACKSTOP_MS: u64 = 60_000;

/// How completions of O_DIRECT reads and writes are found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    /// Interrupt-driven: the completion thread sleeps in the kernel.
    Interrupt,
    /// `IORING_SETUP_IOPOLL`: the completion thread spins in the kernel.
    Iopoll,
    /// `IORING_SETUP_HYBRID_IOPOLL`: sleep about half the shortest
    /// completion time seen, then poll.
    Hybrid,
}

impl PollMode {
    pub fn name(self) -> &'static str {
        match self {
            PollMode::Interrupt => "interrupt",
            PollMode::Iopoll => "iopoll",
            PollMode::Hybrid => "hybrid_iopoll",
        }
    }
}

/// Which I/O engine serves the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Uring,
    Psync,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Uring => "uring",
            EngineKind::Psync => "psync",
        }
    }
}

/// Everything the table line asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileOptions {
    pub path: PathBuf,
    pub direct: bool,
    pub poll: PollMode,
    pub create: bool,
    pub queue_depth: u32,
    pub engine: EngineKind,
    /// While an event loop reaps the ring's completions itself (a
    /// vhost-user-blk queue thread), how long the ring's own thread lets
    /// a completion wait unreaped before it takes it.
    pub reap_backstop_ms: u64,
}

impl FileOptions {
    /// Parse `PATH [direct] [iopoll|hybrid_iopoll] [create] [key=value...]`.
    pub fn parse(args: &[&str]) -> Result<FileOptions, FileError> {
        let (path, rest) = args.split_first().ok_or(FileError::MissingPath)?;
        if path.contains('=') || path.is_empty() {
            return Err(FileError::BadPath(path.to_string()));
        }
        let mut direct = false;
        let mut create = false;
        let mut poll: Option<PollMode> = None;
        let mut kv_words = Vec::new();
        for w in rest {
            let set_flag = |flag: &mut bool, name: &'static str| -> Result<(), FileError> {
                if std::mem::replace(flag, true) {
                    return Err(FileError::FlagTwice(name));
                }
                Ok(())
            };
            match *w {
                "direct" => set_flag(&mut direct, "direct")?,
                "create" => set_flag(&mut create, "create")?,
                "iopoll" | "hybrid_iopoll" => {
                    let mode = if *w == "iopoll" {
                        PollMode::Iopoll
                    } else {
                        PollMode::Hybrid
                    };
                    if let Some(prev) = poll {
                        return Err(FileError::PollConflict {
                            given: mode.name(),
                            previous: prev.name(),
                        });
                    }
                    poll = Some(mode);
                }
                w if w.contains('=') => kv_words.push(w),
                w => return Err(FileError::UnknownFlag(w.to_string())),
            }
        }
        let mut kv = KvArgs::parse("file", &kv_words)?;
        let queue_depth = kv.take_u64(
            "queue_depth",
            DEFAULT_QUEUE_DEPTH as u64,
            1,
            MAX_QUEUE_DEPTH,
        )? as u32;
        let engine = kv.take_choice(
            "engine",
            EngineKind::Uring,
            &[("uring", EngineKind::Uring), ("psync", EngineKind::Psync)],
        )?;
        let reap_backstop_ms = kv.take_u64(
            "reap_backstop_ms",
            DEFAULT_REAP_BACKSTOP_MS,
            1,
            MAX_REAP_BACKSTOP_MS,
        )?;
        kv.finish()?;
        let poll = poll.unwrap_or(PollMode::Interrupt);
        if poll != PollMode::Interrupt && !direct {
            return Err(FileError::PollNeedsDirect(poll.name()));
        }
        if poll != PollMode::Interrupt && engine == EngineKind::Psync {
            return Err(FileError::PollNeedsUring(poll.name()));
        }
        Ok(FileOptions {
            path: PathBuf::from(path),
            direct,
            poll,
            create,
            queue_depth,
            engine,
            reap_backstop_ms,
        })
    }

    /// The canonical argument text (`dmsetup table`): parsing it again
    /// gives the same options.
    pub fn table_args(&self) -> String {
        let mut words = vec![self.path.display().to_string()];
        if self.direct {
            words.push("direct".into());
        }
        if self.poll != PollMode::Interrupt {
            words.push(self.poll.name().into());
        }
        if self.create {
            words.push("create".into());
        }
        if self.queue_depth != DEFAULT_QUEUE_DEPTH {
            words.push(format!("queue_depth={}", self.queue_depth));
        }
        if self.reap_backstop_ms != DEFAULT_REAP_BACKSTOP_MS {
            words.push(format!("reap_backstop_ms={}", self.reap_backstop_ms));
        }
        if self.engine != EngineKind::Uring {
            words.push(format!("engine={}", self.engine.name()));
        }
        words.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_round_trip() {
        let o = FileOptions::parse(&[
            "/tmp/x",
            "direct",
            "hybrid_iopoll",
            "queue_depth=32",
            "reap_backstop_ms=5",
        ])
        .unwrap();
        assert!(o.direct);
        assert_eq!(o.reap_backstop_ms, 5);
        assert_eq!(o.poll, PollMode::Hybrid);
        assert_eq!(o.queue_depth, 32);
        let text = o.table_args();
        let words: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(FileOptions::parse(&words).unwrap(), o);
        assert_eq!(
            FileOptions::parse(&["/tmp/x"]).unwrap().table_args(),
            "/tmp/x"
        );
    }

    #[test]
    fn options_errors_name_the_problem() {
        let e = |a: &[&str]| FileOptions::parse(a).unwrap_err().to_string();
        assert!(e(&[]).contains("missing PATH"));
        assert!(e(&["queue_depth=4"]).contains("PATH"));
        assert!(e(&["/x", "iopoll"]).contains("needs 'direct'"));
        assert!(e(&["/x", "direct", "iopoll", "hybrid_iopoll"]).contains("conflicts"));
        assert!(e(&["/x", "fast"]).contains("unknown flag 'fast'"));
        assert!(e(&["/x", "queue_depth=0"]).contains("queue_depth=0"));
        assert!(e(&["/x", "reap_backstop_ms=0"]).contains("reap_backstop_ms=0"));
        assert!(e(&["/x", "engine=aio"]).contains("engine='aio'"));
        assert!(e(&["/x", "direct", "direct"]).contains("twice"));
        assert!(e(&["/x", "direct", "iopoll", "engine=psync"]).contains("engine=uring"));
        assert!(e(&["/x", "colour=red"]).contains("'colour'"));
        assert!(matches!(
            FileOptions::parse(&["/x", "direct", "iopoll", "hybrid_iopoll"]),
            Err(FileError::PollConflict {
                given: "hybrid_iopoll",
                previous: "iopoll"
            })
        ));
        assert!(matches!(
            FileOptions::parse(&["/x", "queue_depth=4097"]),
            Err(FileError::Args(crate::ArgError::OutOfRange {
                value: 4097,
                ..
            }))
        ));
    }
}
