//! Compiles the C++ shim against an MLX runtime from the PyPI wheels and links it.
//!
//! MLX is found, in this order, at `$MLX_DIR` (the wheel's `mlx` package folder, holding
//! `include/mlx/mlx.h` and `lib/libmlx.so`) or through Python:
//! `$WICK_MLX_PYTHON -c "import mlx; print(mlx.__path__[0])"` (default `python3`).
//! Install the runtime with `pip install "mlx==0.32.4" "mlx-cpu==0.32.4"` (or
//! `mlx-cuda-13` / `mlx-metal` of the same version); see docs/mlx.md.
use std::path::{Path, PathBuf};
use std::process::Command;

/// The MLX version the shim is written and tested against.
const MLX_VERSION: &str = "0.32.4";

fn python_lookup() -> Result<PathBuf, String> {
    let python = std::env::var("WICK_MLX_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args(["-c", "import mlx; print(list(mlx.__path__)[0])"])
        .output()
        .map_err(|e| format!("could not run {python}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{python} cannot import mlx: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn check(dir: &Path) -> Result<(), String> {
    for part in ["include/mlx/mlx.h", "lib/libmlx.so"] {
        let p = dir.join(part);
        let apple = part.ends_with(".so") && dir.join("lib/libmlx.dylib").exists();
        if !(p.exists() || apple) {
            return Err(format!("{} does not exist", p.display()));
        }
    }
    Ok(())
}

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=WICK_MLX_PYTHON");
    println!("cargo:rerun-if-changed=src/shim/shim.cpp");
    println!("cargo:rerun-if-changed=src/shim/shim.h");
    if std::env::var_os("CARGO_FEATURE_RUNTIME").is_none() {
        return;
    }
    let dir = match std::env::var("MLX_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => python_lookup().unwrap_or_else(|e| {
            panic!(
                "wick-mlx: MLX runtime not found ({e}). Set MLX_DIR to the `mlx` folder of an \
                 installed MLX wheel, e.g. `pip install \"mlx=={MLX_VERSION}\" \"mlx-cpu=={MLX_VERSION}\"` \
                 then MLX_DIR=$(python3 -c 'import mlx; print(mlx.__path__[0])')"
            )
        }),
    };
    if let Err(e) = check(&dir) {
        panic!(
            "wick-mlx: {} is not an MLX runtime folder: {e}",
            dir.display()
        );
    }
    let version = std::fs::read_to_string(dir.join("include/mlx/version.h")).unwrap_or_default();
    let [major, minor, patch]: [&str; 3] = {
        let mut it = MLX_VERSION.split('.');
        [
            it.next().unwrap_or("0"),
            it.next().unwrap_or("0"),
            it.next().unwrap_or("0"),
        ]
    };
    for (name, want) in [("MAJOR", major), ("MINOR", minor), ("PATCH", patch)] {
        let line = format!("#define MLX_VERSION_{name} {want}");
        if !version.contains(&line) {
            println!(
                "cargo:warning=wick-mlx is pinned to MLX {MLX_VERSION}; {} holds another version",
                dir.display()
            );
            break;
        }
    }
    let include = dir.join("include");
    let lib = dir.join("lib");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("src/shim/shim.cpp")
        .include(&include)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .opt_level(2)
        .compile("wick_mlx_shim");
    // Link through a symlink to the wheel's folder inside OUT_DIR: cargo puts link paths
    // inside the target directory on the library path of `cargo run` and `cargo test`,
    // and the wheel's own `$ORIGIN/../../mlx_*.libs` lookups still resolve. A binary run
    // outside cargo needs LD_LIBRARY_PATH=<mlx>/lib (scripts/gpu/ sets it).
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let site = dir.parent().unwrap_or(&dir).to_path_buf();
    let mlx_name = dir
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    let link = out.join("mlx-site");
    let _ = std::fs::remove_file(&link);
    let lib = match std::os::unix::fs::symlink(&site, &link) {
        Ok(()) => link.join(mlx_name).join("lib"),
        Err(_) => lib,
    };
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:lib_dir={}", lib.display());
}
