//! Without the `runtime` feature the crate links no MLX and says so on every entry point.
#![cfg(not(feature = "runtime"))]
use wick_mlx::{Array, Device, MlxError, Stream};

#[test]
fn every_entry_point_reports_the_missing_runtime() {
    assert_eq!(Stream::new(Device::Cpu).unwrap_err(), MlxError::NotLinked);
    assert_eq!(
        Array::from_slice(&[1.0f32], &[1]).unwrap_err(),
        MlxError::NotLinked
    );
    assert!(!wick_mlx::gpu_available());
    assert!(MlxError::NotLinked.to_string().contains("runtime"));
}
