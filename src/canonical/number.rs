//! JSON numbers as exact decimals, and their canonical layout.
//!
//! RFC 8785 rounds every number through an IEEE 754 double; here numbers
//! keep their exact decimal value instead (see the [`crate::canonical`]
//! docs), written in the ECMAScript `Number::toString` layout that RFC 8785
//! §3.2.2.3 uses.

use std::fmt;

/// Largest magnitude of a number's decimal exponent in scientific notation
/// (the `e` in `d.ddd × 10^e`) accepted for a non-zero number. This keeps
/// exponent arithmetic bounded; zero is accepted with any exponent.
pub(crate) const MAX_DECIMAL_EXPONENT: i64 = 1_000_000;

/// A JSON number, kept as its exact decimal value.
///
/// Normalized on construction: the value is `digits × 10^exponent` with no
/// leading or trailing zeros in `digits`, and zero has a single
/// representation. Structural equality is therefore equality of values:
/// `1`, `1.0`, `1e0` and `10e-1` are equal, `-0` equals `0`.
///
/// `Display` writes the canonical form.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Number {
    negative: bool,
    /// ASCII digits without leading or trailing zeros; empty for zero.
    digits: String,
    /// Power of ten applied to `digits`; 0 for zero.
    exponent: i64,
}

/// A number whose decimal exponent is beyond [`MAX_DECIMAL_EXPONENT`].
#[derive(Debug)]
pub(crate) struct OutOfRange;

/// The significant digits of a non-zero decimal, read from two slices as
/// one sequence (the integer and fraction digits of a JSON number, borrowed
/// from the input), without leading or trailing zeros.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Digits<'a> {
    head: &'a [u8],
    tail: &'a [u8],
}

impl Digits<'_> {
    fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    /// Appends digits `from..to` (indices into the whole sequence).
    fn write_range(&self, from: usize, to: usize, out: &mut Vec<u8>) {
        let h = self.head.len();
        out.extend_from_slice(self.head.get(from.min(h)..to.min(h)).unwrap_or_default());
        out.extend_from_slice(
            self.tail
                .get(from.max(h) - h..to.max(h) - h)
                .unwrap_or_default(),
        );
    }
}

/// Normalizes the parts of a JSON number: `int` and `frac` are ASCII digits
/// (`frac` possibly empty) and `exponent` the value after `e`, saturated.
/// Returns `None` for zero, else the significant digits `d` and the power
/// of ten `scale` such that the value is `d × 10^scale`.
///
/// # Errors
///
/// [`OutOfRange`] if the number is not zero and its exponent in scientific
/// notation is beyond ±[`MAX_DECIMAL_EXPONENT`].
pub(crate) fn normalize<'a>(
    int: &'a [u8],
    frac: &'a [u8],
    exponent: i64,
) -> Result<Option<(Digits<'a>, i64)>, OutOfRange> {
    let all = || int.iter().chain(frac.iter());
    let Some(leading) = all().position(|&b| b != b'0') else {
        return Ok(None);
    };
    let trailing = all().rev().position(|&b| b != b'0').unwrap_or(0);
    let total = int.len() + frac.len();
    let k = total - leading - trailing;
    let whole = Digits {
        head: int,
        tail: frac,
    };
    let (from, to, h) = (leading, total - trailing, int.len());
    let digits = Digits {
        head: whole.head.get(from.min(h)..to.min(h)).unwrap_or_default(),
        tail: whole
            .tail
            .get(from.max(h) - h..to.max(h) - h)
            .unwrap_or_default(),
    };
    // i128 cannot overflow here: every term is an i64 or a usize.
    let scale = i128::from(exponent) - frac.len() as i128 + trailing as i128;
    let scientific = scale + k as i128 - 1;
    if scientific.unsigned_abs() > u128::from(MAX_DECIMAL_EXPONENT.unsigned_abs()) {
        return Err(OutOfRange);
    }
    let scale = i64::try_from(scale).map_err(|_| OutOfRange)?;
    Ok(Some((digits, scale)))
}

/// Writes `±digits × 10^scale` (non-zero, from [`normalize`]) in the
/// ECMAScript `Number::toString` layout used by RFC 8785 §3.2.2.3, with the
/// exact digits.
pub(crate) fn write_normalized(negative: bool, digits: Digits<'_>, scale: i64, out: &mut Vec<u8>) {
    if negative {
        out.push(b'-');
    }
    // k digits, value = digits × 10^(n − k). Normalization bounds |n − 1|
    // by MAX_DECIMAL_EXPONENT, and k by the input length: no overflow.
    let len = digits.len();
    let k = i64::try_from(len).unwrap_or(i64::MAX);
    let n = k.saturating_add(scale);
    if k <= n && n <= 21 {
        digits.write_range(0, len, out);
        out.extend(std::iter::repeat_n(
            b'0',
            usize::try_from(n - k).unwrap_or(0),
        ));
    } else if 0 < n && n <= 21 {
        let split = usize::try_from(n).unwrap_or(0);
        digits.write_range(0, split, out);
        out.push(b'.');
        digits.write_range(split, len, out);
    } else if -6 < n && n <= 0 {
        out.extend_from_slice(b"0.");
        out.extend(std::iter::repeat_n(b'0', usize::try_from(-n).unwrap_or(0)));
        digits.write_range(0, len, out);
    } else {
        digits.write_range(0, 1, out);
        if len > 1 {
            out.push(b'.');
            digits.write_range(1, len, out);
        }
        let e = n.saturating_sub(1);
        out.push(b'e');
        out.push(if e < 0 { b'-' } else { b'+' });
        write_decimal(e.unsigned_abs(), out);
    }
}

/// Appends `n` in decimal.
fn write_decimal(mut n: u64, out: &mut Vec<u8>) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(buf.get(i..).unwrap_or_default());
}

impl Number {
    /// The number `±(int ++ frac) × 10^(exponent − frac.len())`, from the
    /// parts of a JSON number: `int` and `frac` are ASCII digits (`frac`
    /// possibly empty) and `exponent` the value after `e`, saturated.
    ///
    /// # Errors
    ///
    /// [`OutOfRange`] if the number is not zero and its exponent in
    /// scientific notation is beyond ±[`MAX_DECIMAL_EXPONENT`].
    pub(crate) fn from_parts(
        negative: bool,
        int: &[u8],
        frac: &[u8],
        exponent: i64,
    ) -> Result<Number, OutOfRange> {
        Ok(match normalize(int, frac, exponent)? {
            None => Number {
                negative: false,
                digits: String::new(),
                exponent: 0,
            },
            Some((d, scale)) => {
                let mut digits = Vec::with_capacity(d.len());
                d.write_range(0, d.len(), &mut digits);
                Number {
                    negative,
                    // ASCII digits only: the conversion loses nothing.
                    digits: String::from_utf8_lossy(&digits).into_owned(),
                    exponent: scale,
                }
            }
        })
    }

    /// Writes the number in the ECMAScript `Number::toString` layout used by
    /// RFC 8785 §3.2.2.3, with the exact digits.
    pub(crate) fn write_canonical(&self, out: &mut Vec<u8>) {
        if self.digits.is_empty() {
            out.push(b'0');
            return;
        }
        let digits = Digits {
            head: self.digits.as_bytes(),
            tail: &[],
        };
        write_normalized(self.negative, digits, self.exponent, out);
    }
}

impl fmt::Display for Number {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = Vec::new();
        self.write_canonical(&mut out);
        // Only ASCII was written; lossy conversion cannot lose anything.
        f.write_str(&String::from_utf8_lossy(&out))
    }
}

#[cfg(test)]
mod tests {
    use super::super::parser::parse;
    use super::super::value::JsonValue;
    use super::super::{canonicalize, CanonicalError};

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn canon(input: &str) -> Result<String, Box<dyn std::error::Error>> {
        Ok(String::from_utf8(canonicalize(input.as_bytes())?)?)
    }

    /// RFC 8785 Appendix B: each expected output, used as input, is kept as
    /// is (it is written with the shortest round-trip digits), and other
    /// spellings of the same decimal give the same output.
    ///
    /// Differ by design: an input that is not the shortest round-trip form
    /// keeps its exact value, where RFC 8785 rounds it through a double:
    /// `295147905179352825856` (2^68 written exactly) stays as is where RFC
    /// 8785 gives `295147905179352830000`, `9007199254740993` stays where RFC
    /// 8785 gives `9007199254740992`, `333333333.33333329` stays where RFC
    /// 8785 gives `333333333.3333333`, and `1e400` is `1e+400` where RFC 8785
    /// rejects it as infinite.
    #[test]
    fn rfc8785_appendix_b_numbers() -> TestResult {
        let same = [
            "0",
            "5e-324",
            "-5e-324",
            "1.7976931348623157e+308",
            "-1.7976931348623157e+308",
            "9007199254740992",
            "-9007199254740992",
            "295147905179352830000",
            "9.999999999999997e+22",
            "1e+23",
            "1.0000000000000001e+23",
            "999999999999999700000",
            "999999999999999900000",
            "1e+21",
            "9.999999999999997e-7",
            "0.000001",
            "333333333.3333332",
            "333333333.33333325",
            "333333333.3333333",
            "333333333.3333334",
            "333333333.33333343",
            "-0.0000033333333333333333",
            "1424953923781206.2",
        ];
        for n in same {
            assert_eq!(canon(n)?, n, "{n}");
        }
        let respelled = [
            ("-0", "0"),
            ("2.95147905179352830000e20", "295147905179352830000"),
            ("1e23", "1e+23"),
            ("1E21", "1e+21"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("9.999999999999997E-7", "9.999999999999997e-7"),
            ("1e-6", "0.000001"),
            ("1e-7", "1e-7"),
            ("0.0000001", "1e-7"),
            ("1e30", "1e+30"),
            ("1E30", "1e+30"),
            ("4.50", "4.5"),
            ("2e-3", "0.002"),
            ("0.002", "0.002"),
            ("0.000000000000000000000000001", "1e-27"),
            ("14249539237812062e-1", "1424953923781206.2"),
        ];
        for (input, expected) in respelled {
            assert_eq!(canon(input)?, expected, "{input}");
        }
        Ok(())
    }

    #[test]
    fn exact_numbers_deviate_from_rfc8785_by_design() -> TestResult {
        assert_eq!(canon("295147905179352825856")?, "295147905179352825856");
        assert_eq!(canon("9007199254740993")?, "9007199254740993");
        assert_ne!(parse(b"9007199254740993")?, parse(b"9007199254740992")?);
        assert_eq!(canon("333333333.33333329")?, "333333333.33333329");
        assert_eq!(canon("1e400")?, "1e+400");
        assert_eq!(canon("-1.5e-400")?, "-1.5e-400");
        Ok(())
    }

    #[test]
    fn equal_values_are_equal_numbers() -> TestResult {
        for n in ["1", "1.0", "1e0", "10e-1", "0.1e1", "1.000E+0", "100e-2"] {
            assert_eq!(canon(n)?, "1", "{n}");
            assert_eq!(parse(n.as_bytes())?, parse(b"1")?, "{n}");
        }
        for n in [
            "0",
            "-0",
            "0.0",
            "-0.0e-5",
            "0.0e5",
            "0e999999999999999999999",
        ] {
            assert_eq!(canon(n)?, "0", "{n}");
            assert_eq!(parse(n.as_bytes())?, parse(b"0")?, "{n}");
        }
        assert_eq!(canon("-1.0")?, "-1");
        assert_eq!(canon("120")?, "120");
        assert_eq!(canon("12.50")?, "12.5");
        assert_eq!(canon("0.5")?, "0.5");
        let JsonValue::Number(n) = parse(b"-12.500e3")? else {
            return Err("not a number".into());
        };
        assert!(n.negative && !n.digits.is_empty());
        assert_eq!(
            (n.digits.as_str(), n.exponent, n.to_string()),
            ("125", 2, "-12500".to_owned())
        );
        Ok(())
    }

    #[test]
    fn exponent_limits() -> TestResult {
        assert_eq!(canon("1e1000000")?, "1e+1000000");
        assert_eq!(canon("1e-1000000")?, "1e-1000000");
        // 10 × 10^999999 = 1e+1000000: the limit is on the normalized exponent.
        assert_eq!(canon("10e999999")?, "1e+1000000");
        for input in [
            "1e1000001",
            "1e-1000001",
            "[0, 1e999999999999999999]",
            "-1E-99999999999999999999999",
        ] {
            let err = parse(input.as_bytes()).err();
            assert!(
                matches!(err, Some(CanonicalError::NumberOutOfRange { .. })),
                "{input}: {err:?}"
            );
        }
        let err = parse(b"[0, 1e999999999999999999]")
            .err()
            .ok_or("accepted")?;
        assert_eq!(err.position().map(|p| p.offset), Some(4));
        assert_eq!(
            err.to_string(),
            "number at byte 4 (line 1, column 5) is out of range: its decimal exponent exceeds ±1000000"
        );
        // Output stays proportional to the input.
        assert_eq!(canon("1e400")?, "1e+400");
        assert_eq!(canon("123e-400")?, "1.23e-398");
        Ok(())
    }
}
