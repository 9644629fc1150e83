//! Prints a GGUF file's metadata (arrays abbreviated) and tensor directory.
use wick_gguf::{GgufFile, MetadataValue};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: gguf_dump FILE [--tensors]")?;
    let show_tensors = std::env::args().any(|a| a == "--tensors");
    let f = GgufFile::open(&path)?;
    println!("GGUF v{} {} tensors", f.version(), f.tensors().len());
    for (k, v) in f.metadata().entries() {
        match v {
            MetadataValue::Array(a) => println!(
                "{k} = [{} items] first: {:?}",
                a.len(),
                a.iter().take(4).collect::<Vec<_>>()
            ),
            MetadataValue::String(s) if s.len() > 120 => {
                println!("{k} = string of {} bytes", s.len())
            }
            v => println!("{k} = {v:?}"),
        }
    }
    if show_tensors {
        for t in f.tensors() {
            println!("{} {:?} {}", t.name, t.shape(), t.dtype);
        }
    }
    Ok(())
}
