# A real program's allocations: perl building a hash of N keys with values of 0 to 63 bytes
# (several allocations per key). Prints perl's own time per key, start-up excluded.
use Time::HiRes qw(time);
my $n = $ARGV[0] // 100000;
my $start = time;
my %hash;
$hash{"key$_"} = "v" x ($_ % 64) for 1 .. $n;
printf "ns_per_pair %.1f\n", (time - $start) * 1e9 / $n;
