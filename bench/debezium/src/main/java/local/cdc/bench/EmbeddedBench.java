package local.cdc.bench;

import com.sun.management.OperatingSystemMXBean;
import io.debezium.engine.ChangeEvent;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.format.Json;
import java.io.FileReader;
import java.io.Reader;
import java.lang.management.ManagementFactory;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;

/**
 * Debezium's PostgreSQL connector in an embedded engine, its events (JSON converter) handed to a consumer in this
 * process that counts them and their bytes; no Kafka. Run by bench/debezium_bench.py:
 *
 *   java -cp ... local.cdc.bench.EmbeddedBench engine.properties EXPECTED_EVENTS TIMEOUT_S TOPIC
 *
 * The properties file holds the engine and connector settings; the database password comes from the environment
 * (DEBEZIUM_BENCH_PASSWORD), never from a file or the command line. Prints one JSON line: events, bytes of the
 * values, and the wall and CPU seconds of this process from just before the engine is built until the consumer has
 * counted EXPECTED_EVENTS of TOPIC (the JVM's own start-up is left out; connector start-up and JIT warm-up are in),
 * and the same from the first event on (streaming alone).
 */
public final class EmbeddedBench {

    private EmbeddedBench() {
    }

    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        try (Reader reader = new FileReader(args[0])) {
            props.load(reader);
        }
        String password = System.getenv("DEBEZIUM_BENCH_PASSWORD");
        if (password != null) {
            props.setProperty("database.password", password);
        }
        long expected = Long.parseLong(args[1]);
        long timeoutS = Long.parseLong(args[2]);
        String topic = args[3];
        OperatingSystemMXBean os = (OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();

        CountDownLatch done = new CountDownLatch(1);
        AtomicReference<String> failure = new AtomicReference<>();
        long[] counted = new long[2]; // events, value bytes (touched by the engine's one consumer thread)
        long[] marks = new long[4]; // first event nanos, last event nanos, CPU nanos at the last and the first event

        long startNanos = System.nanoTime();
        long startCpu = os.getProcessCpuTime();
        DebeziumEngine<ChangeEvent<String, String>> engine = DebeziumEngine.create(Json.class)
                .using(props)
                .using((success, message, error) -> {
                    if (!success) {
                        failure.set(message + (error != null ? ": " + error : ""));
                    }
                    done.countDown();
                })
                .notifying((List<ChangeEvent<String, String>> records,
                            DebeziumEngine.RecordCommitter<ChangeEvent<String, String>> committer) -> {
                    for (ChangeEvent<String, String> record : records) {
                        String value = record.value();
                        if (value != null && topic.equals(record.destination())) {
                            if (counted[0] == 0) {
                                marks[0] = System.nanoTime();
                                marks[3] = os.getProcessCpuTime();
                            }
                            counted[0]++;
                            counted[1] += value.length();
                        }
                        committer.markProcessed(record);
                    }
                    committer.markBatchFinished();
                    if (counted[0] >= expected && marks[1] == 0) {
                        marks[1] = System.nanoTime();
                        marks[2] = os.getProcessCpuTime();
                        done.countDown();
                    }
                })
                .build();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        boolean finished = done.await(timeoutS, TimeUnit.SECONDS);
        engine.close();
        executor.shutdown();
        executor.awaitTermination(60, TimeUnit.SECONDS);
        if (!finished || marks[1] == 0) {
            String why = failure.get() != null ? failure.get() : "timed out after " + timeoutS + " s";
            System.out.println("{\"error\": \"" + why.replace("\\", "\\\\").replace("\"", "'").replace("\n", " ")
                    + "\", \"events\": " + counted[0] + "}");
            System.exit(2);
        }
        System.out.printf("{\"events\": %d, \"bytes\": %d, \"seconds\": %.3f, \"cpu_seconds\": %.3f, "
                        + "\"first_event_seconds\": %.3f, \"streaming_seconds\": %.3f, "
                        + "\"streaming_cpu_seconds\": %.3f, \"jvm_cpu_seconds\": %.3f}%n",
                counted[0], counted[1], (marks[1] - startNanos) / 1e9, (marks[2] - startCpu) / 1e9,
                (marks[0] - startNanos) / 1e9, (marks[1] - marks[0]) / 1e9, (marks[2] - marks[3]) / 1e9,
                os.getProcessCpuTime() / 1e9);
        System.exit(0);
    }
}
