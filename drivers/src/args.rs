//! `key=value` arguments of a leaf driver's dm table line.
//!
//! Leaf targets (`null`, `memory`) take optional knobs after the length, the
//! way null_blk takes module parameters (`irqmode=1 completion_nsec=20000`).
//! Every driver parses them through [`KvArgs`], so the error text names the
//! driver and the offending key the same way everywhere, and a key given
//! twice or never consumed is an error rather than silently ignored.

/// Parsed `key=value` arguments; each accessor consumes its key, and
/// [`KvArgs::finish`] rejects whatever nobody asked for.
pub struct KvArgs<'a> {
    driver: &'static str,
    pairs: Vec<(&'a str, &'a str, bool)>,
}

impl<'a> KvArgs<'a> {
    pub fn parse(driver: &'static str, args: &[&'a str]) -> Result<KvArgs<'a>, String> {
        let mut pairs: Vec<(&'a str, &'a str, bool)> = Vec::with_capacity(args.len());
        for arg in args {
            let (k, v) = arg.split_once('=').ok_or_else(|| {
                format!("{driver}: argument '{arg}' is not of the form key=value")
            })?;
            if k.is_empty() {
                return Err(format!("{driver}: argument '{arg}' has an empty key"));
            }
            if pairs.iter().any(|(pk, _, _)| *pk == k) {
                return Err(format!("{driver}: argument '{k}' given twice"));
            }
            pairs.push((k, v, false));
        }
        Ok(KvArgs { driver, pairs })
    }

    pub fn driver(&self) -> &'static str {
        self.driver
    }

    /// The raw value of `key`, if given.
    pub fn take_str(&mut self, key: &str) -> Option<&'a str> {
        self.pairs.iter_mut().find(|(k, _, _)| *k == key).map(|p| {
            p.2 = true;
            p.1
        })
    }

    /// An unsigned integer in `min..=max`, or `default` when absent.
    pub fn take_u64(&mut self, key: &str, default: u64, min: u64, max: u64) -> Result<u64, String> {
        let driver = self.driver;
        match self.take_str(key) {
            None => Ok(default),
            Some(v) => {
                let n: u64 = v
                    .parse()
                    .map_err(|_| format!("{driver}: {key}='{v}' is not an unsigned integer"))?;
                if n < min || n > max {
                    return Err(format!("{driver}: {key}={n} is out of range {min}..={max}"));
                }
                Ok(n)
            }
        }
    }

    /// `0`/`1` (also `off`/`on`, `false`/`true`), or `default` when absent.
    pub fn take_bool(&mut self, key: &str, default: bool) -> Result<bool, String> {
        let driver = self.driver;
        match self.take_str(key) {
            None => Ok(default),
            Some("0" | "off" | "false" | "no") => Ok(false),
            Some("1" | "on" | "true" | "yes") => Ok(true),
            Some(v) => Err(format!(
                "{driver}: {key}='{v}' is not a boolean (0/1, off/on)"
            )),
        }
    }

    /// One of `choices` (matched exactly), or `default` when absent.
    pub fn take_choice<T: Copy>(
        &mut self,
        key: &str,
        default: T,
        choices: &[(&str, T)],
    ) -> Result<T, String> {
        let driver = self.driver;
        match self.take_str(key) {
            None => Ok(default),
            Some(v) => choices
                .iter()
                .find(|(name, _)| *name == v)
                .map(|(_, t)| *t)
                .ok_or_else(|| {
                    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
                    format!("{driver}: {key}='{v}' is not one of {}", names.join("|"))
                }),
        }
    }

    /// A logical block size: a power of two in 512..=4096.
    pub fn take_block_size(&mut self, key: &str) -> Result<u32, String> {
        let bs = self.take_u64(key, 512, 512, 4096)?;
        if !bs.is_power_of_two() {
            return Err(format!(
                "{}: {key}={bs} is not a power of two in 512..=4096",
                self.driver
            ));
        }
        Ok(bs as u32)
    }

    /// Error on any argument no accessor consumed.
    pub fn finish(self) -> Result<(), String> {
        match self.pairs.iter().find(|(_, _, used)| !used) {
            None => Ok(()),
            Some((k, _, _)) => Err(format!("{}: unknown argument '{k}'", self.driver)),
        }
    }
}

/// Check that a device size is a whole, non-zero number of blocks.
pub fn check_size(driver: &str, size_bytes: u64, block_size: u32) -> Result<(), String> {
    if size_bytes == 0 {
        return Err(format!("{driver}: device size is zero"));
    }
    if !size_bytes.is_multiple_of(block_size as u64) {
        return Err(format!(
            "{driver}: size {size_bytes} bytes is not a multiple of the block size {block_size}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_bad_values_name_the_key() {
        let mut a = KvArgs::parse("null", &["bs=4096", "colour=red"]).unwrap();
        assert_eq!(a.take_block_size("bs").unwrap(), 4096);
        let e = a.finish().unwrap_err();
        assert!(e.contains("colour"), "{e}");

        let mut a = KvArgs::parse("null", &["bs=1000"]).unwrap();
        let e = a.take_block_size("bs").unwrap_err();
        assert!(e.contains("bs=1000"), "{e}");

        let e = KvArgs::parse("null", &["bs"]).err().unwrap();
        assert!(e.contains("'bs'"), "{e}");
        let e = KvArgs::parse("null", &["bs=512", "bs=512"]).err().unwrap();
        assert!(e.contains("twice"), "{e}");

        let mut a = KvArgs::parse("null", &["n=abc"]).unwrap();
        assert!(a.take_u64("n", 0, 0, 10).unwrap_err().contains("n='abc'"));
        let mut a = KvArgs::parse("null", &["n=11"]).unwrap();
        assert!(a.take_u64("n", 0, 0, 10).unwrap_err().contains("n=11"));
    }

    #[test]
    fn size_must_be_whole_blocks() {
        assert!(check_size("m", 0, 512).is_err());
        assert!(check_size("m", 4096 + 512, 4096).is_err());
        assert!(check_size("m", 8192, 4096).is_ok());
    }
}
