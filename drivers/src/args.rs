//! `key=value` arguments of a leaf driver's dm table line.
//!
//! Leaf targets (`null`, `memory`) take optional knobs after the length, the
//! way null_blk takes module parameters (`irqmode=1 completion_nsec=20000`).
//! Every driver parses them through [`KvArgs`], so the error text names the
//! driver and the offending key the same way everywhere, and a key given
//! twice or never consumed is an error rather than silently ignored.

use crate::error::ArgError;

/// Parsed `key=value` arguments; each accessor consumes its key, and
/// [`KvArgs::finish`] rejects whatever nobody asked for.
pub struct KvArgs<'a> {
    driver: &'static str,
    pairs: Vec<(&'a str, &'a str, bool)>,
}

impl<'a> KvArgs<'a> {
    pub fn parse(driver: &'static str, args: &[&'a str]) -> Result<KvArgs<'a>, ArgError> {
        let mut pairs: Vec<(&'a str, &'a str, bool)> = Vec::with_capacity(args.len());
        for arg in args {
            let (k, v) = arg.split_once('=').ok_or_else(|| ArgError::MissingValue {
                driver,
                arg: arg.to_string(),
            })?;
            if k.is_empty() {
                return Err(ArgError::EmptyKey {
                    driver,
                    arg: arg.to_string(),
                });
            }
            if pairs.iter().any(|(pk, _, _)| *pk == k) {
                return Err(ArgError::Duplicate {
                    driver,
                    key: k.to_string(),
                });
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

    fn bad_value(&self, key: &str, value: &str, expected: String) -> ArgError {
        ArgError::BadValue {
            driver: self.driver,
            key: key.to_string(),
            value: value.to_string(),
            expected,
        }
    }

    /// An unsigned integer in `min..=max`, or `default` when absent.
    pub fn take_u64(
        &mut self,
        key: &str,
        default: u64,
        min: u64,
        max: u64,
    ) -> Result<u64, ArgError> {
        let Some(v) = self.take_str(key) else {
            return Ok(default);
        };
        let n: u64 = v
            .parse()
            .map_err(|_| self.bad_value(key, v, "an unsigned integer".into()))?;
        if n < min || n > max {
            return Err(ArgError::OutOfRange {
                driver: self.driver,
                key: key.to_string(),
                value: n,
                min,
                max,
            });
        }
        Ok(n)
    }

    /// `0`/`1` (also `off`/`on`, `false`/`true`), or `default` when absent.
    pub fn take_bool(&mut self, key: &str, default: bool) -> Result<bool, ArgError> {
        match self.take_str(key) {
            None => Ok(default),
            Some("0" | "off" | "false" | "no") => Ok(false),
            Some("1" | "on" | "true" | "yes") => Ok(true),
            Some(v) => Err(self.bad_value(key, v, "a boolean (0/1, off/on)".into())),
        }
    }

    /// One of `choices` (matched exactly), or `default` when absent.
    pub fn take_choice<T: Copy>(
        &mut self,
        key: &str,
        default: T,
        choices: &[(&str, T)],
    ) -> Result<T, ArgError> {
        let Some(v) = self.take_str(key) else {
            return Ok(default);
        };
        choices
            .iter()
            .find(|(name, _)| *name == v)
            .map(|(_, t)| *t)
            .ok_or_else(|| {
                let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
                self.bad_value(key, v, format!("one of {}", names.join("|")))
            })
    }

    /// A logical block size: a power of two in 512..=4096.
    pub fn take_block_size(&mut self, key: &str) -> Result<u32, ArgError> {
        let bs = self.take_u64(key, 512, 512, 4096)?;
        check_block_size(self.driver, key, bs)
    }

    /// Error on any argument no accessor consumed.
    pub fn finish(self) -> Result<(), ArgError> {
        match self.pairs.iter().find(|(_, _, used)| !used) {
            None => Ok(()),
            Some((k, _, _)) => Err(ArgError::UnknownKey {
                driver: self.driver,
                key: k.to_string(),
            }),
        }
    }
}

/// Check a logical block size given from Rust or a table (`key` names it
/// in the error): a power of two in 512..=4096.
pub fn check_block_size(driver: &'static str, key: &str, bs: u64) -> Result<u32, ArgError> {
    if !(512..=4096).contains(&bs) || !bs.is_power_of_two() {
        return Err(ArgError::BadBlockSize {
            driver,
            key: key.to_string(),
            value: bs,
        });
    }
    Ok(bs as u32)
}

/// Check that a device size is a whole, non-zero number of blocks.
pub fn check_size(driver: &'static str, size_bytes: u64, block_size: u32) -> Result<(), ArgError> {
    if size_bytes == 0 {
        return Err(ArgError::ZeroSize { driver });
    }
    if !size_bytes.is_multiple_of(block_size as u64) {
        return Err(ArgError::SizeNotBlockMultiple {
            driver,
            size_bytes,
            block_size,
        });
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
        assert_eq!(
            e,
            ArgError::UnknownKey {
                driver: "null",
                key: "colour".into()
            }
        );
        assert_eq!(e.to_string(), "null: unknown argument 'colour'");

        let mut a = KvArgs::parse("null", &["bs=1000"]).unwrap();
        let e = a.take_block_size("bs").unwrap_err().to_string();
        assert!(e.contains("bs=1000"), "{e}");

        let e = KvArgs::parse("null", &["bs"]).err().unwrap();
        assert!(matches!(e, ArgError::MissingValue { .. }), "{e:?}");
        assert!(e.to_string().contains("'bs'"), "{e}");
        let e = KvArgs::parse("null", &["bs=512", "bs=512"]).err().unwrap();
        assert!(e.to_string().contains("twice"), "{e}");
        let e = KvArgs::parse("null", &["=512"]).err().unwrap();
        assert!(matches!(e, ArgError::EmptyKey { .. }), "{e:?}");

        let mut a = KvArgs::parse("null", &["n=abc"]).unwrap();
        let e = a.take_u64("n", 0, 0, 10).unwrap_err().to_string();
        assert_eq!(e, "null: n='abc' is not an unsigned integer");
        let mut a = KvArgs::parse("null", &["n=11"]).unwrap();
        let e = a.take_u64("n", 0, 0, 10).unwrap_err();
        assert!(matches!(e, ArgError::OutOfRange { value: 11, .. }), "{e:?}");
        assert!(e.to_string().contains("n=11"), "{e}");
        let mut a = KvArgs::parse("null", &["b=maybe", "c=x"]).unwrap();
        let e = a.take_bool("b", false).unwrap_err().to_string();
        assert!(e.contains("b='maybe'"), "{e}");
        let e = a
            .take_choice("c", 0, &[("y", 1), ("z", 2)])
            .unwrap_err()
            .to_string();
        assert_eq!(e, "null: c='x' is not one of y|z");
    }

    #[test]
    fn size_must_be_whole_blocks() {
        assert!(check_size("m", 0, 512).is_err());
        assert!(check_size("m", 4096 + 512, 4096).is_err());
        assert!(check_size("m", 8192, 4096).is_ok());
    }
}
