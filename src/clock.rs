//! The filter's clock: Envoy's wall clock in whole seconds, except that it never goes back.
//!
//! Every stamp the filter keeps in shared data (a pin's last use, a prefix entry's, a rank's
//! cool-down end, a worker's load column) is compared with later readings of this clock. Envoy
//! hands out wall-clock time, which an operator or NTP may step backwards; read as it comes,
//! every stamp written before such a step would lie in the future for as long as the step: pins
//! that neither expire nor get evicted (while live conversations re-pinned after the step go
//! first), a rank kept in cool-down and a dead worker's load counted for the step's length. So a
//! step back is absorbed into an offset and the filter's time goes on from where it was, at the
//! wall clock's pace. A step forward is taken as it comes (it looks like time passing: entries
//! expire a little early, once) — unless the wall clock then comes back from more than a year
//! ahead: that was a stray reading, not time, and the VM starts again from the wall clock (kept,
//! it would hold every VM that saw it a year or more ahead of the others for good, or stop time
//! at `u32::MAX`).
//!
//! Every worker's VM keeps its own offset, but all of them meet at one floor: the latest time
//! any of them read, published in shared data ([`FLOOR_KEY`]). A VM started after a step (a new
//! module loaded) starts from that floor too, so all workers keep one time.

/// Shared-data key of the floor: the latest filter time any VM read, 4 bytes little-endian.
/// The wall clock is the same for every configuration in the process, so one key serves all.
pub const FLOOR_KEY: &str = "dp_affinity.clock_floor";

/// A floor further than this ahead of a VM's own time is not one a step back left (a year of
/// steps back in one process's life): it is ignored, and replaced by the VM's time. Taken as it
/// comes, a stray value would move every VM's time that far at once; near `u32::MAX` it would
/// stop it for good (the sum saturates), and with it every expiry the filter relies on: dead
/// workers' load, cool-downs, pins.
pub const MAX_FLOOR_AHEAD_SECONDS: u32 = 366 * 24 * 3600;

/// A stamp in shared data (a pin's or a prefix entry's last use, a load column's) further than
/// this ahead of the filter's time was not written by this clock (workers' ticks differ by a
/// second or two at most): it reads as expired, so a stray value cannot outlive everything
/// else in its bucket or keep a column counted.
pub const STAMP_AHEAD_SECONDS: u32 = 60;

/// Whether `stamp` may have been written by the filter's clock, at `now` or before it.
pub fn plausible_stamp(stamp: u32, now: u32) -> bool {
    stamp <= now.saturating_add(STAMP_AHEAD_SECONDS)
}

/// One VM's clock: its offset over the wall clock and its latest reading. The floor passed to
/// [`SteadyClock::read`] must be read before the wall clock: then it comes from readings made
/// before this one and can only exceed it after a step back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SteadyClock {
    offset: u32,
    now: u32,
}

impl SteadyClock {
    /// Reads the wall clock (`wall`, unix seconds) against `floor` (the published floor, 0 when
    /// none): the filter's time, never before the floor nor this VM's previous reading. A floor
    /// more than [`MAX_FLOOR_AHEAD_SECONDS`] ahead of this VM's time is ignored: the caller
    /// publishes the reading whenever it differs from the floor it passed.
    pub fn read(&mut self, wall: u32, floor: u32) -> u32 {
        if self.now > wall.saturating_add(MAX_FLOOR_AHEAD_SECONDS) {
            // More than a year ahead of the wall clock: no step back leaves that (see
            // `MAX_FLOOR_AHEAD_SECONDS`), a stray forward reading did. Start again from the wall
            // clock, as a VM that ignores such a floor does, so that all VMs meet again.
            *self = SteadyClock::default();
        }
        let time = wall.saturating_add(self.offset);
        let floor = if floor > time.saturating_add(MAX_FLOOR_AHEAD_SECONDS) {
            self.now
        } else {
            floor.max(self.now)
        };
        if time < floor {
            // The wall clock went back (here or, seen through the floor, in another VM).
            self.offset = self.offset.saturating_add(floor - time);
            self.now = floor;
        } else {
            self.now = time;
        }
        self.now
    }

    /// The latest reading.
    pub fn now(&self) -> u32 {
        self.now
    }
}

/// The floor as stored; anything but 4 bytes reads as none.
pub fn decode_floor(bytes: Option<&[u8]>) -> u32 {
    bytes
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, u32::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_wall_clock_and_absorbs_steps_back() {
        let mut c = SteadyClock::default();
        // (wall, floor, filter time)
        let steps = [
            (10_000, 0, 10_000),
            (10_001, 10_000, 10_001),
            (10_005, 10_001, 10_005),
            // Stepped back an hour: time stands at the last reading, then goes on.
            (6_406, 10_005, 10_005),
            (6_407, 10_005, 10_006),
            (6_417, 10_006, 10_016),
            // Stepped forward again: taken as it comes (time passing).
            (10_100, 10_016, 13_699),
            (10_101, 13_699, 13_700),
        ];
        for (i, (wall, floor, want)) in steps.into_iter().enumerate() {
            assert_eq!(c.read(wall, floor), want, "step {i}");
            assert_eq!(c.now(), want);
        }
    }

    #[test]
    fn every_vm_meets_the_published_floor() {
        // VM a saw the wall clock step back; VM b, started after the step, and VM c, which had
        // not read the clock since, take the floor a published.
        let mut a = SteadyClock::default();
        a.read(10_000, 0);
        let floor = a.read(6_400, 10_000);
        let mut b = SteadyClock::default();
        assert_eq!(b.read(6_400, floor), 10_000);
        assert_eq!(b.read(6_460, floor), 10_060);
        let mut c = SteadyClock::default();
        c.read(9_999, 0);
        assert_eq!(c.read(6_401, floor), 10_000);
        assert_eq!(
            (a.read(6_460, floor), c.read(6_460, floor)),
            (10_060, 10_059)
        );
    }

    /// Workers reading the floor before the wall clock, ticking in every order around second
    /// boundaries: no step, so the filter's time stays the wall clock's.
    #[test]
    fn no_step_no_drift() {
        let mut clocks = [SteadyClock::default(); 3];
        let mut floor = 0u32;
        for wall in 1_000u32..1_200 {
            for turn in 0..3 {
                let i = (wall as usize + turn) % 3;
                // Read the floor, then the wall clock (which may have moved on meanwhile).
                let seen = floor;
                let now = clocks[i].read(wall + u32::from(turn == 2), seen);
                floor = floor.max(now);
            }
        }
        for c in &clocks {
            assert!(c.now() <= 1_200, "{c:?}");
        }
        assert!(floor <= 1_200);
    }

    /// A floor no step back can explain (a stray or foreign value) leaves the time alone: taken,
    /// one near `u32::MAX` stopped it for good. A real step back is still absorbed.
    #[test]
    fn a_floor_far_ahead_is_ignored() {
        let wall = 1_760_000_000u32;
        for stray in [u32::MAX - 15, wall + MAX_FLOOR_AHEAD_SECONDS + 101] {
            let mut c = SteadyClock::default();
            assert_eq!(c.read(wall, stray), wall);
            assert_eq!(c.read(wall + 100, stray), wall + 100, "time goes on");
        }
        let mut c = SteadyClock::default();
        assert_eq!(
            c.read(wall, wall + MAX_FLOOR_AHEAD_SECONDS),
            wall + MAX_FLOOR_AHEAD_SECONDS
        );
        let mut d = SteadyClock::default();
        d.read(wall + 50, 0);
        assert_eq!(
            d.read(wall, u32::MAX),
            wall + 50,
            "never back, whatever the floor"
        );
    }

    /// A stray wall-clock reading far ahead, then corrected: time goes on from the wall clock
    /// (kept, it stood at `u32::MAX` for good), and a VM that saw the stray reading meets one
    /// started after it (kept, the two ran a year or more apart, each reading the other's
    /// stamps as expired or foreign).
    #[test]
    fn a_stray_reading_far_ahead_does_not_hold_time() {
        let wall = 1_760_000_000u32;
        let mut c = SteadyClock::default();
        assert_eq!(c.read(wall, 0), wall);
        let stray = c.read(u32::MAX, wall);
        assert_eq!(stray, u32::MAX, "a step forward is taken as it comes");
        let a = c.read(wall + 10, stray);
        let b = c.read(wall + 20, a);
        assert_eq!(
            (a, b),
            (wall + 10, wall + 20),
            "time goes on from the wall clock"
        );

        let mut seen = SteadyClock::default();
        let mut floor = seen.read(wall, 0);
        floor = seen.read(wall + 2 * MAX_FLOOR_AHEAD_SECONDS, floor);
        floor = seen.read(wall + 1, floor);
        let mut started_after = SteadyClock::default();
        let later = started_after.read(wall + 2, floor);
        let earlier = seen.read(wall + 2, later);
        assert!(
            earlier.abs_diff(later) <= STAMP_AHEAD_SECONDS,
            "two times in one process: {earlier} and {later}"
        );
        // A step back within the year is still absorbed after all this.
        let now = later.max(earlier);
        assert_eq!(seen.read(wall - 100, now), now);
    }

    #[test]
    fn stamps_ahead_of_the_clock() {
        assert!(plausible_stamp(100, 100));
        assert!(plausible_stamp(100 + STAMP_AHEAD_SECONDS, 100));
        assert!(!plausible_stamp(101 + STAMP_AHEAD_SECONDS, 100));
        assert!(plausible_stamp(u32::MAX, u32::MAX - 1));
    }

    #[test]
    fn reads_the_floor_bytes() {
        assert_eq!(decode_floor(Some(&7u32.to_le_bytes())), 7);
        for bad in [None, Some(&b""[..]), Some(&b"12345"[..])] {
            assert_eq!(decode_floor(bad), 0);
        }
    }
}
