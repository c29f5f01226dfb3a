//! Print the driver version and every device, through the sys crate alone.
//!
//! `cargo run -p metrale-cuda-sys --example device_info`; without a driver it exits
//! with status 2 and the loader's message.

use std::process::ExitCode;

use metrale_cuda_sys as sys;

fn check(call: &str, status: sys::CUresult) -> Result<(), String> {
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("{call} failed: {status}"))
    }
}

fn run(d: &sys::Driver) -> Result<(), Box<dyn std::error::Error>> {
    let mut version = 0;
    let mut count = 0;
    // SAFETY: each call gets valid pointers to locals of the types it writes.
    unsafe {
        check("cuInit", (d.cuInit()?)(0))?;
        check(
            "cuDriverGetVersion",
            (d.cuDriverGetVersion()?)(&mut version),
        )?;
        check("cuDeviceGetCount", (d.cuDeviceGetCount()?)(&mut count))?;
    }
    println!(
        "driver {} (CUDA {}.{}), {count} device(s), loaded from {}",
        version,
        version / 1000,
        version % 1000 / 10,
        d.path()
    );
    for ordinal in 0..count {
        let mut device = 0;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: as above; the name buffer's length is passed with it.
        unsafe {
            check("cuDeviceGet", (d.cuDeviceGet()?)(&mut device, ordinal))?;
            check(
                "cuDeviceGetName",
                (d.cuDeviceGetName()?)(name.as_mut_ptr(), name.len() as i32, device),
            )?;
        }
        // SAFETY: the driver wrote a NUL-terminated string within the buffer.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
        println!("device {ordinal}: {}", name.to_string_lossy());
    }
    Ok(())
}

fn main() -> ExitCode {
    let d = match sys::driver() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("device_info: {e}");
            return ExitCode::from(2);
        }
    };
    match run(d) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("device_info: {e}");
            ExitCode::FAILURE
        }
    }
}
