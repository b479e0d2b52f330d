//! `blkstack luks open|table|dump`: LUKS volumes made by cryptsetup,
//! opened as a `file` leaf over the image and a `crypt` device over it
//! (what `cryptsetup open` loads into the kernel), on the running server.
//! Header parsing and unlocking are `blkstack_mapped::luks`; this file
//! reads the passphrase and talks to the control socket. Formatting a new
//! volume, and adding or removing keys, stay with `cryptsetup`, which
//! works on an image file without root.

use crate::cli::{call, connect, ControlOpt};
use anyhow::{bail, Context};
use blkstack_mapped::luks;
use serde_json::json;
use std::io::Read;
use std::path::{Path, PathBuf};
use zeroize::Zeroizing;

/// `blkstack luks ...`.
#[derive(clap::Subcommand, Debug)]
pub enum LuksVerb {
    /// Unlock a LUKS1/LUKS2 image and create NAME (a crypt device over
    /// NAME_raw, a file leaf over the image) on the running server.
    Open(OpenArgs),
    /// Unlock and print the stack file (`NAME_raw: ...` and `NAME: ...`
    /// lines) for `serve --stack`, key included: keep it private.
    Table(OpenArgs),
    /// Print the header as `cryptsetup luksDump` does (the fields blkstack reads).
    Dump {
        /// The LUKS image.
        image: PathBuf,
    },
}

/// `luks open` / `luks table` arguments.
#[derive(clap::Args, Debug)]
pub struct OpenArgs {
    /// The LUKS image file.
    pub image: PathBuf,
    /// Name of the device to create.
    pub name: String,
    /// Read the passphrase from this file (all of it, as cryptsetup's
    /// --key-file); without it, one line from standard input.
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<PathBuf>,
}

/// `blkstack luks`.
#[derive(clap::Args, Debug)]
pub struct LuksArgs {
    /// For `open` (given before it: `blkstack luks --control S open ...`).
    #[command(flatten)]
    pub control: ControlOpt,
    #[command(subcommand)]
    pub verb: LuksVerb,
}

fn passphrase(key_file: &Option<PathBuf>) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let mut pass = Zeroizing::new(Vec::new());
    match key_file {
        Some(f) => {
            std::fs::File::open(f)
                .and_then(|h| h.take(8 << 20).read_to_end(&mut pass))
                .with_context(|| format!("reading key file {}", f.display()))?;
        }
        None => {
            std::io::stdin()
                .take(8 << 10)
                .read_to_end(&mut pass)
                .context("reading the passphrase from standard input")?;
            if let Some(n) = pass.iter().position(|&b| b == b'\n') {
                pass.truncate(n);
            }
        }
    }
    Ok(pass)
}

/// The two stack lines for the volume: the file leaf and the crypt device.
fn stack(
    image: &Path,
    name: &str,
    key_file: &Option<PathBuf>,
) -> anyhow::Result<[(String, String); 2]> {
    let pass = passphrase(key_file)?;
    let u = luks::unlock(image, &pass).with_context(|| format!("{}", image.display()))?;
    let size = std::fs::metadata(image)
        .with_context(|| format!("{}", image.display()))?
        .len();
    let image = std::fs::canonicalize(image)?;
    let raw = format!("{name}_raw");
    let sectors = u.sectors(size);
    if sectors == 0 {
        bail!("{}: the data segment is empty", image.display());
    }
    Ok([
        (
            raw.clone(),
            format!("0 {} file {}", size / 512, image.display()),
        ),
        (
            name.to_string(),
            format!("0 {sectors} crypt {}", u.crypt_args(&raw)),
        ),
    ])
}

/// Run `blkstack luks`.
pub fn run(a: LuksArgs) -> anyhow::Result<()> {
    match a.verb {
        LuksVerb::Dump { image } => {
            let h = luks::read_header(&image).with_context(|| format!("{}", image.display()))?;
            print!(
                "{}",
                luks::dump(&h).replace("IMAGE", &image.display().to_string())
            );
            Ok(())
        }
        LuksVerb::Table(o) => {
            for (n, t) in stack(&o.image, &o.name, &o.key_file)? {
                println!("{n}: {t}");
            }
            Ok(())
        }
        LuksVerb::Open(o) => {
            let devs = stack(&o.image, &o.name, &o.key_file)?;
            let mut c = connect(&a.control)?;
            let (raw, vol) = (&devs[0], &devs[1]);
            call(
                &mut c,
                "create",
                &raw.0,
                json!({ "name": raw.0, "table": raw.1 }),
            )?;
            if let Err(e) = call(
                &mut c,
                "create",
                &vol.0,
                json!({ "name": vol.0, "table": vol.1 }),
            ) {
                let _ = call(
                    &mut c,
                    "remove",
                    &raw.0,
                    json!({ "name": raw.0, "force": false }),
                );
                return Err(e);
            }
            Ok(())
        }
    }
}
