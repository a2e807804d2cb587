//! Write a state dict in PyTorch's zip format (`torch.save`), for checkpoints whose library reads
//! only `pytorch_model.bin` (mamba_ssm). Each tensor is one storage holding its raw bytes, so
//! values pass through unchanged; the pickle uses only what `torch.load(weights_only=True)`
//! accepts (`_rebuild_tensor_v2`, typed storages, `OrderedDict`).

use anyhow::{bail, Result};
use std::borrow::Cow;
use std::io::Write;
use std::path::Path;

/// A tensor as raw little-endian bytes.
pub struct RawTensor<'a> {
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl safetensors::View for RawTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn storage_class(dtype: safetensors::Dtype) -> Result<&'static str> {
    Ok(match dtype {
        safetensors::Dtype::BF16 => "BFloat16Storage",
        safetensors::Dtype::F16 => "HalfStorage",
        safetensors::Dtype::F32 => "FloatStorage",
        safetensors::Dtype::F64 => "DoubleStorage",
        safetensors::Dtype::I64 => "LongStorage",
        safetensors::Dtype::I32 => "IntStorage",
        d => bail!("cannot write {d:?} tensors to a PyTorch checkpoint"),
    })
}

/// Pickle opcodes used below (protocol 2).
fn unicode(p: &mut Vec<u8>, s: &str) {
    p.push(b'X'); // BINUNICODE
    p.extend((s.len() as u32).to_le_bytes());
    p.extend(s.as_bytes());
}

fn int(p: &mut Vec<u8>, v: usize) -> Result<()> {
    if v > i32::MAX as usize {
        p.push(0x8a); // LONG1
        p.push(8);
        p.extend((v as i64).to_le_bytes());
    } else {
        p.push(b'J'); // BININT
        p.extend((v as i32).to_le_bytes());
    }
    Ok(())
}

/// Write `tensors` (name → raw little-endian data) as a `torch.save` archive at `path`.
pub fn write_pth(path: &Path, tensors: &[(String, RawTensor<'_>)]) -> Result<()> {
    use zip::write::SimpleFileOptions;
    let opts = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored).large_file(true);
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path)?);
    let mut pkl: Vec<u8> = vec![0x80, 2, b'}', b'(']; // PROTO 2, EMPTY_DICT, MARK
    for (i, (name, t)) in tensors.iter().enumerate() {
        let elem = t.dtype.bitsize() / 8;
        let numel = t.data.len() / elem.max(1);
        let strides: Vec<usize> = (0..t.shape.len()).map(|d| t.shape[d + 1..].iter().product()).collect();
        unicode(&mut pkl, name);
        pkl.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(("); // GLOBAL, MARK, MARK
        unicode(&mut pkl, "storage");
        pkl.extend(format!("ctorch\n{}\n", storage_class(t.dtype)?).as_bytes());
        unicode(&mut pkl, &i.to_string());
        unicode(&mut pkl, "cpu");
        int(&mut pkl, numel)?;
        pkl.extend(b"tQ"); // TUPLE, BINPERSID
        int(&mut pkl, 0)?; // storage offset
        for v in [&t.shape, &strides] {
            pkl.push(b'(');
            for &d in v.iter() {
                int(&mut pkl, d)?;
            }
            pkl.push(b't');
        }
        pkl.extend(b"\x89ccollections\nOrderedDict\n)RtR"); // requires_grad=False, hooks, REDUCE
        zip.start_file(format!("archive/data/{i}"), opts)?;
        zip.write_all(&t.data)?;
    }
    pkl.extend(b"u."); // SETITEMS, STOP
    zip.start_file("archive/data.pkl", opts)?;
    zip.write_all(&pkl)?;
    zip.start_file("archive/byteorder", opts)?;
    zip.write_all(b"little")?;
    zip.start_file("archive/version", opts)?;
    zip.write_all(b"3\n")?;
    zip.finish()?;
    Ok(())
}
