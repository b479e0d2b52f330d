//! `blkstack verity format|verify|dump`: veritysetup's commands for
//! making and checking a dm-verity hash tree on image files or block
//! devices, so a `verity` table can be built without cryptsetup (and
//! a tree cryptsetup built can be checked without it). The work is in
//! blkstack_mapped::targets::verity::format; this is the command line,
//! with veritysetup's option names and defaults (cryptsetup's
//! src/veritysetup.c).

use anyhow::{bail, Context, Result};
use blkstack_mapped::targets::verity::format::{self, Params};
use blkstack_mapped::targets::verity::tree::HashAlg;
use clap::{Args, Subcommand};
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// `blkstack verity ...`.
#[derive(Args)]
pub struct VerityArgs {
    #[command(subcommand)]
    cmd: VerityCmd,
}

#[derive(Subcommand)]
enum VerityCmd {
    /// Build the hash tree of DATA on HASH and print the root hash (veritysetup format).
    Format {
        /// The data image or device.
        data: PathBuf,
        /// The hash image or device (created if missing).
        hash: PathBuf,
        #[command(flatten)]
        p: TreeOpts,
        /// Salt in hex, or `-` for none (default: 32 random bytes).
        #[arg(long, value_name = "HEX")]
        salt: Option<String>,
        /// The superblock's UUID (default: a random one).
        #[arg(long)]
        uuid: Option<String>,
    },
    /// Check DATA against the tree on HASH and ROOT (veritysetup verify).
    Verify {
        /// The data image or device.
        data: PathBuf,
        /// The hash image or device.
        hash: PathBuf,
        /// The root hash, in hex.
        root: String,
        #[command(flatten)]
        p: TreeOpts,
        /// Salt in hex, or `-` for none (with --no-superblock).
        #[arg(long, value_name = "HEX")]
        salt: Option<String>,
    },
    /// Print the superblock of HASH (veritysetup dump).
    Dump {
        /// The hash image or device.
        hash: PathBuf,
        /// Byte offset of the superblock on HASH.
        #[arg(long, default_value_t = 0)]
        hash_offset: u64,
    },
}

/// The tree's parameters, veritysetup's options and defaults.
#[derive(Args)]
struct TreeOpts {
    /// Bytes per data block.
    #[arg(long, default_value_t = 4096)]
    data_block_size: u32,
    /// Bytes per hash block.
    #[arg(long, default_value_t = 4096)]
    hash_block_size: u32,
    /// Data blocks to cover (default: the whole data image).
    #[arg(long)]
    data_blocks: Option<u64>,
    /// Byte offset of the superblock (or the tree) on HASH.
    #[arg(long, default_value_t = 0)]
    hash_offset: u64,
    /// The digest: sha1, sha224, sha256, sha384 or sha512.
    #[arg(long = "hash", id = "hash_alg", default_value = "sha256")]
    hash_alg: String,
    /// Format (hash type): 1, or 0 for Chrome OS's.
    #[arg(long, default_value_t = 1)]
    format: u32,
    /// No superblock: the tree starts at --hash-offset, and verify needs
    /// every parameter given.
    #[arg(long)]
    no_superblock: bool,
}

fn open(path: &Path, write: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    if write {
        o.write(true).create(true).mode(0o600);
    }
    o.open(path)
        .with_context(|| format!("cannot open {}", path.display()))
}

fn size(f: &mut File, path: &Path) -> Result<u64> {
    f.seek(SeekFrom::End(0))
        .with_context(|| format!("cannot size {}", path.display()))
}

fn parse_salt(s: Option<&str>) -> Result<Vec<u8>> {
    match s {
        Some("-") => Ok(Vec::new()),
        Some(h) => format::unhex(h).with_context(|| format!("invalid salt '{h}': not hex")),
        None => Ok(rand::random::<[u8; 32]>().to_vec()),
    }
}

fn parse_uuid(s: Option<&str>) -> Result<[u8; 16]> {
    let Some(s) = s else {
        let mut u: [u8; 16] = rand::random();
        u[6] = (u[6] & 0x0f) | 0x40;
        u[8] = (u[8] & 0x3f) | 0x80;
        return Ok(u);
    };
    format::unhex(&s.replace('-', ""))
        .and_then(|b| <[u8; 16]>::try_from(b).ok())
        .with_context(|| format!("invalid UUID '{s}'"))
}

impl TreeOpts {
    fn params(&self, data: &mut File, data_path: &Path, salt: Vec<u8>) -> Result<Params> {
        let alg = HashAlg::parse(&self.hash_alg).with_context(|| {
            format!(
                "hash algorithm '{}' not supported (sha1, sha224, sha256, sha384, sha512)",
                self.hash_alg
            )
        })?;
        let data_blocks = match self.data_blocks {
            Some(n) => n,
            None => size(data, data_path)? / u64::from(self.data_block_size.max(1)),
        };
        Ok(Params {
            version: self.format,
            alg,
            data_block_size: self.data_block_size,
            hash_block_size: self.hash_block_size,
            data_blocks,
            hash_offset: self.hash_offset,
            salt,
            uuid: None,
        })
    }
}

/// Run one `blkstack verity` command.
pub fn run(a: VerityArgs) -> Result<()> {
    match a.cmd {
        VerityCmd::Format {
            data,
            hash,
            p,
            salt,
            uuid,
        } => {
            let mut d = open(&data, false)?;
            let mut params = p.params(&mut d, &data, parse_salt(salt.as_deref())?)?;
            if !p.no_superblock {
                params.uuid = Some(parse_uuid(uuid.as_deref())?);
            }
            if params.data_blocks == 0 {
                bail!("{}: no data blocks to hash", data.display());
            }
            // Refuse bad parameters before the hash device is created.
            params.check()?;
            params.geometry()?;
            let h = open(&hash, true)?;
            let root = format::format(&params, &d, &h)?;
            h.sync_all()
                .with_context(|| format!("cannot sync {}", hash.display()))?;
            print!(
                "{}",
                format::report(&params, &hash.display().to_string(), Some(&root))?
            );
        }
        VerityCmd::Verify {
            data,
            hash,
            root,
            p,
            salt,
        } => {
            let mut d = open(&data, false)?;
            let h = open(&hash, false)?;
            let params = if p.no_superblock {
                p.params(
                    &mut d,
                    &data,
                    parse_salt(Some(salt.as_deref().unwrap_or("-")))?,
                )?
            } else {
                Params::read_superblock(&h, p.hash_offset)?
            };
            let root = format::unhex(&root)
                .filter(|r| r.len() == params.alg.digest_size())
                .with_context(|| format!("invalid root hash '{root}'"))?;
            format::verify(&params, &d, &h, &root)?;
        }
        VerityCmd::Dump { hash, hash_offset } => {
            let h = open(&hash, false)?;
            let params = Params::read_superblock(&h, hash_offset)?;
            print!(
                "{}",
                format::report(&params, &hash.display().to_string(), None)?
            );
        }
    }
    Ok(())
}
