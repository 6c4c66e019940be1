//! Maps as files Python tools read: NumPy's `.npy` (format 1.0,
//! little-endian f32, C order; `numpy.load` gives the `[batch, heads, q,
//! k]` array) and JSON (`{"tokens": [...], "attention": [layer][batch]
//! [head][q][k]}`, the nesting of bertviz's `head_view(attention,
//! tokens)` once each layer is turned into a tensor).

use crate::VizError;
use std::fmt::Write as _;
use std::path::Path;

fn io(path: &Path, e: std::io::Error) -> VizError {
    VizError::Output(format!("{}: {e}", path.display()))
}

fn check(dims: &[usize], len: usize) -> Result<(), VizError> {
    if dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(len) {
        return Err(VizError::Input(format!("{len} values for dims {dims:?}")));
    }
    Ok(())
}

/// The bytes of a `.npy` file holding `data` (f32) with shape `dims`.
pub fn npy_bytes(dims: &[usize], data: &[f32]) -> Result<Vec<u8>, VizError> {
    check(dims, data.len())?;
    let shape = match dims {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            dims.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic (6) + version (2) + header length (2) + header, padded with
    // spaces and a newline to a multiple of 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.div_ceil(64) * 64 - unpadded));
    header.push('\n');
    let len = u16::try_from(header.len())
        .map_err(|_| VizError::Input(format!("{} dims are too many for .npy 1.0", dims.len())))?;
    let mut out = Vec::with_capacity(10 + header.len() + 4 * data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for x in data {
        out.extend_from_slice(&x.to_le_bytes());
    }
    Ok(out)
}

/// Writes `data` with shape `dims` as a `.npy` file.
pub fn write_npy(path: &Path, dims: &[usize], data: &[f32]) -> Result<(), VizError> {
    let bytes = npy_bytes(dims, data)?;
    std::fs::write(path, bytes).map_err(|e| io(path, e))
}

/// One layer's maps: `[batch, heads, q, k]` f32, row-major.
#[derive(Clone, Copy, Debug)]
pub struct LayerMaps<'a> {
    /// `[batch, heads, q, k]`.
    pub dims: [usize; 4],
    /// The probabilities.
    pub data: &'a [f32],
}

fn json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The JSON text of `layers` with `tokens`: `{"tokens": [...],
/// "attention": [layer][batch][head][q][k]}`; a non-finite weight (NaN)
/// is `null`, every other the shortest decimal that reads back to the
/// same f32.
pub fn json(layers: &[LayerMaps<'_>], tokens: &[&str]) -> Result<String, VizError> {
    let mut out = String::from("{\"tokens\": [");
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        json_str(t, &mut out);
    }
    out.push_str("], \"attention\": [");
    for (li, l) in layers.iter().enumerate() {
        check(&l.dims, l.data.len())?;
        if li > 0 {
            out.push_str(", ");
        }
        nest(&l.dims, l.data, &mut out);
    }
    out.push_str("]}\n");
    Ok(out)
}

fn nest(dims: &[usize], data: &[f32], out: &mut String) {
    out.push('[');
    match dims {
        [] | [_] => {
            for (i, x) in data.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                if x.is_finite() {
                    let _ = write!(out, "{x}");
                } else {
                    out.push_str("null");
                }
            }
        }
        [d, rest @ ..] => {
            let step = rest.iter().product::<usize>();
            for i in 0..*d {
                if i > 0 {
                    out.push_str(", ");
                }
                nest(rest, &data[i * step..(i + 1) * step], out);
            }
        }
    }
    out.push(']');
}

/// Writes [`json`] to `path`.
pub fn write_json(path: &Path, layers: &[LayerMaps<'_>], tokens: &[&str]) -> Result<(), VizError> {
    let text = json(layers, tokens)?;
    std::fs::write(path, text).map_err(|e| io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header NumPy writes for a float32 array of shape (2, 3), and
    /// its data after it.
    #[test]
    fn npy_layout() {
        let b = npy_bytes(&[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.5]).unwrap();
        assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        let h = std::str::from_utf8(&b[10..10 + hl]).unwrap();
        assert!(h.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
        assert!(h.ends_with('\n'));
        assert_eq!(b.len(), 10 + hl + 24);
        assert_eq!(&b[b.len() - 4..], &5.5f32.to_le_bytes());
        let one = npy_bytes(&[4], &[0.0; 4]).unwrap();
        assert!(one.windows(4).any(|w| w == b"(4,)"));
        assert!(npy_bytes(&[2, 2], &[0.0; 3]).is_err());
    }

    #[test]
    fn json_nesting_and_escapes() {
        let data = [0.5f32, 0.25, f32::NAN, 1.0];
        let s = json(
            &[LayerMaps {
                dims: [1, 1, 2, 2],
                data: &data,
            }],
            &["a\"b", "c"],
        )
        .unwrap();
        assert_eq!(
            s,
            "{\"tokens\": [\"a\\\"b\", \"c\"], \"attention\": [[[[[0.5, 0.25], [null, 1]]]]]}\n"
        );
    }
}
