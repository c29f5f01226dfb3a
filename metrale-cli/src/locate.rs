//! Where a loaded library lives: the file mapped at the address of one of its
//! functions, read from `/proc/self/maps` (Linux). Elsewhere, or when the maps
//! cannot be read, the name the loader was given is all there is.

/// The file mapped at `addr` in this process, when the system says.
pub fn file_at(addr: usize) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        // `start-end perms offset dev inode   path`
        let mut fields = line.split_whitespace();
        let range = fields.next()?;
        let (start, end) = range.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        if !(start..end).contains(&addr) {
            return None;
        }
        let path = fields.nth(4)?;
        path.starts_with('/').then(|| path.to_owned())
    })
}

/// The resolved file of a library loaded from `given`, at an address `addr` of
/// one of its functions: the mapped file, or `given` when that cannot be read.
pub fn resolve(given: &str, addr: Option<usize>) -> String {
    addr.and_then(file_at).unwrap_or_else(|| given.to_owned())
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_this_test_binary_for_one_of_its_functions() {
        let here = super::file_at(super::file_at as fn(usize) -> Option<String> as usize);
        #[cfg(target_os = "linux")]
        assert!(here.is_some_and(|p| p.starts_with('/')));
        #[cfg(not(target_os = "linux"))]
        let _ = here;
    }
}
