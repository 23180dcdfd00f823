//! Free space in the rows array: tables of files come and go with the processes that map them.

/// First-fit allocation of row ranges in an array of fixed capacity.
#[derive(Debug, Clone)]
pub struct RowSpace {
    capacity: u32,
    /// Free ranges as (first, length), sorted and never adjacent.
    free: Vec<(u32, u32)>,
}

impl RowSpace {
    pub fn new(capacity: u32) -> Self {
        Self { capacity, free: vec![(0, capacity)] }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn used(&self) -> u32 {
        self.capacity - self.free.iter().map(|(_, length)| length).sum::<u32>()
    }

    /// Whether no row of `first..first + rows` that lies below the capacity is in use.
    pub fn is_free(&self, first: u64, rows: u64) -> bool {
        let end = (first + rows).min(u64::from(self.capacity));
        first >= end
            || self
                .free
                .iter()
                .any(|&(start, length)| u64::from(start) <= first && end <= u64::from(start) + u64::from(length))
    }

    /// Whether a range of `rows` rows is free: `alloc` would succeed.
    pub fn fits(&self, rows: u32) -> bool {
        self.free.iter().any(|(_, length)| *length >= rows)
    }

    /// The first row of a free range of `rows` rows, or None when no range is that long.
    pub fn alloc(&mut self, rows: u32) -> Option<u32> {
        let index = self.free.iter().position(|(_, length)| *length >= rows)?;
        let (first, length) = self.free[index];
        if length == rows {
            self.free.remove(index);
        } else {
            self.free[index] = (first + rows, length - rows);
        }
        Some(first)
    }

    /// Gives back a range `alloc` returned, merging it with its free neighbours.
    pub fn free(&mut self, first: u32, rows: u32) {
        if rows == 0 {
            return;
        }
        let index = self.free.partition_point(|(start, _)| *start < first);
        self.free.insert(index, (first, rows));
        if index + 1 < self.free.len() && first + rows == self.free[index + 1].0 {
            self.free[index].1 += self.free.remove(index + 1).1;
        }
        if index > 0 && self.free[index - 1].0 + self.free[index - 1].1 == first {
            self.free[index - 1].1 += self.free.remove(index).1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_reused_and_merged() {
        let mut space = RowSpace::new(100);
        let a = space.alloc(30).unwrap();
        let b = space.alloc(30).unwrap();
        let c = space.alloc(30).unwrap();
        assert_eq!((a, b, c, space.used()), (0, 30, 60, 90));
        assert_eq!(space.alloc(11), None);
        space.free(b, 30);
        assert_eq!(space.alloc(20), Some(30));
        space.free(30, 20);
        space.free(a, 30);
        space.free(c, 30);
        assert_eq!(space.used(), 0);
        assert_eq!(space.alloc(100), Some(0));
    }

    #[test]
    fn free_ranges_are_told_from_used_ones() {
        let mut space = RowSpace::new(100);
        assert!(space.is_free(0, 100) && space.is_free(64, 64) && space.fits(100));
        let a = space.alloc(30).unwrap();
        assert!(!space.is_free(0, 64) && space.is_free(30, 70) && space.is_free(64, 64));
        assert!(space.fits(70) && !space.fits(71));
        space.free(a, 30);
        assert!(space.is_free(0, 64));
    }
}
